#!/usr/bin/env bash
# Verify a regular (non-editable) `pip install .` in a brand-new virtual
# environment: verl_dmd and verl import, and the installed package finds its
# config tree and recipes from outside the repository. Takes 2-3 minutes.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "check_install: fresh venv in $work" >&2
"$python" -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$vpy" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$vpy" -m pip install --quiet --disable-pip-version-check "$root"

cd "$work"  # away from the source tree, so only the installed copy can be imported
"$vpy" - <<'PY'
import verl, verl_dmd
from verl_dmd import config_dir, recipes_dir
assert "site-packages" in verl_dmd.__file__, verl_dmd.__file__
assert (config_dir() / "dmd2.yaml").is_file(), config_dir()
assert (recipes_dir() / "digits_dmd2.yaml").is_file(), recipes_dir()
print(f"check_install: verl {verl.__version__}, verl_dmd from {verl_dmd.__file__}")
print(f"check_install: config {config_dir()}, recipes {recipes_dir()}")
PY
"$work/venv/bin/verl-dmd" --list-recipes
"$work/venv/bin/verl-dmd" trainer.output_dir="$work/out" | tail -n 3
echo "check_install: ok" >&2
