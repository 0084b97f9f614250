#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install verl_dmd in it.
#
# Idempotent and cheap when nothing changed: a stamp records the hash of
# setup.py and the Python version, so the install reruns only when they change.
#   VERL_DMD_VENV  where the environment lives (default: <repo>/.venv)
#   PYTHON         the interpreter to build it from (default: python3)
# torch: a machine that already has torch (a GPU image) reuses it through
# --system-site-packages; otherwise the CPU wheel torch==2.13.0 is installed
# first, because an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VERL_DMD_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.verl_dmd-install-stamp"

want="$( { cat "$root/setup.py"; "$python" --version 2>&1; } | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

echo "verl_dmd setup: preparing $venv (first run takes about 2-3 minutes)" >&2
if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c "import torch" >/dev/null 2>&1; then
    echo "verl_dmd setup: reusing the torch already installed for $python" >&2
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi

vpy="$venv/bin/python"

# pip install, minus this machine's warnings about absent local index folders;
# pip's own exit status is kept. pip byte-compiles what it installs: a third of the set-up on
# 2 cores, but without it a machine with PYTHONDONTWRITEBYTECODE=1 (as CI's) compiles every
# imported module again in every process (measured: the test suite 49 min instead of about 25).
pip_install() {
  local status=0
  "$vpy" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 |
    { grep -v 'is ignored: it is neither a file nor a directory' || true; } >&2 || status=$?
  return "$status"
}

pip_install --upgrade pip
if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
  echo "verl_dmd setup: installing torch==2.13.0 (CPU wheel)" >&2
  pip_install "torch==2.13.0"
fi
echo "verl_dmd setup: installing verl_dmd and its dependencies (verl, ray, diffusers, peft, hydra)" >&2
pip_install -e "$root[test]"
"$vpy" -c "import verl_dmd, verl, torch; print(f'verl_dmd setup: ok (torch {torch.__version__}, verl {verl.__version__})')" >&2
echo "$want" >"$stamp"
