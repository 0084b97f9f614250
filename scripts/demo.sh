#!/usr/bin/env bash
# The main job (README quick start): set up, then run the default digits recipe.
# Extra arguments are hydra overrides, e.g. `bash scripts/demo.sh algorithm.fake_update_ratio=3`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${VERL_DMD_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" -m verl_dmd.main --config-name digits_dmd2 "$@"
