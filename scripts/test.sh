#!/usr/bin/env bash
# The test command (README quick start, CI): set up, lint, format check, pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k plan -x`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${VERL_DMD_VENV:-$root/.venv}"
cd "$root"

echo "== ruff check" >&2
"$venv/bin/ruff" check .
echo "== ruff format --check" >&2
"$venv/bin/ruff" format --check .

echo "== pytest" >&2
status=0
"$venv/bin/python" -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests: nothing was verified, failing" >&2
  exit 1
fi
exit "$status"
