#!/usr/bin/env bash
# The main job (README quick start): set up, validate the default digits recipe, distil it, print the table.
# Extra arguments are dotted overrides, e.g. `bash scripts/demo.sh trainer.total_steps=100`.
#
# Today the distillation runs in one process without ray (scripts/distill_digits.py);
# the ray trainer replaces it when it lands (see README "Status").
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${VERL_DMD_VENV:-$root/.venv}"
cd "$root"
"$venv/bin/python" -m verl_dmd.main --config-name digits_dmd2 "$@"
exec "$venv/bin/python" scripts/distill_digits.py "$@"
