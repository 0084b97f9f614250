#!/usr/bin/env bash
# The main job (README quick start): set up, then distil the shipped digits teacher with the default
# recipe on 2 ray workers (CPU), print the quality table, and export the student.
# Extra arguments are dotted overrides, e.g. `bash scripts/demo.sh trainer.total_steps=100`.
# Relaunching the same command resumes from the newest checkpoint (checkpoint.resume=auto).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${VERL_DMD_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/verl-dmd" --config-name digits_dmd2 "$@"
