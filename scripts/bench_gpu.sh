#!/usr/bin/env bash
# The GPU benchmarks of docs/benchmarks.md in one place (one NVIDIA GPU, no ray).
#   bash scripts/bench_gpu.sh offload OUTDIR   # sleep/wake: both layouts, default vs packing/coalescing off (~6 min on an H200)
#   bash scripts/bench_gpu.sh phases OUTDIR    # DMD2 phases, compiled, kept gathered (~6 min on an H200)
#   bash scripts/bench_gpu.sh check OUTDIR     # sleep/wake before every phase trains bit for bit alike (~1 min)
#   bash scripts/bench_gpu.sh attention OUTDIR # the shared layout at batch 8 with each attention kernel (~7 min)
# Each run writes its JSON (and the profile) into OUTDIR; the tables print to stdout. The JSONs name the
# code ("code"): from git, or from VERL_DMD_COMMIT=<commit> where the copy has no .git (the lent machine).
set -euo pipefail
what="${1:?usage: bench_gpu.sh offload|phases|check|attention OUTDIR}"
out="${2:?usage: bench_gpu.sh offload|phases|check|attention OUTDIR}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
mkdir -p "$out"
case "$what" in
  offload)
    off="$py $here/bench_offload.py --device cuda --hidden 1536 --repeats 5"
    $off --layers 6 --json "$out/offload_independent.json"
    $off --layers 6 --no-pack --json "$out/offload_independent_unpacked.json"
    # The pool kept between rounds (sleep(release=False)): wakes must reuse its segments, not add more.
    $off --layers 6 --keep-reserved --repeats 3 --json "$out/offload_independent_kept.json"
    # 48 layers: with the frozen base stored in bfloat16 the 24-layer state is under 8 GiB.
    $off --layout shared_base_adapters --layers 48 --json "$out/offload_shared_lora.json"
    $off --layout shared_base_adapters --layers 48 --no-coalesce --json "$out/offload_shared_lora_uncoalesced.json"
    $off --layout shared_base_adapters --layers 48 --no-pack --no-coalesce --json "$out/offload_shared_lora_plain.json"
    ;;
  check)
    # Training with sleep/wake before every phase equals training without, bit for bit (~1 min).
    for layout in shared_base_adapters independent; do
      CUBLAS_WORKSPACE_CONFIG=:4096:8 $py "$here/check_sleep_training.py" --device cuda --layout $layout \
        | tee "$out/check_sleep_training_$layout.txt"
    done
    ;;
  phases)
    ph="$py $here/bench_phases.py --repeats 2 --compile --keep-gathered"
    $ph --layouts shared_base_adapters --batch 8 --profile "$out" --trace-device "$out" --json "$out/phases_shared_batch8.json"
    $ph --layouts shared_base_adapters --batch 16 --json "$out/phases_shared_batch16.json"
    $ph --layouts independent_full --batch 8 --json "$out/phases_independent_full_batch8.json"
    ;;
  attention)
    for backend in cudnn flash efficient; do
      $py "$here/bench_phases.py" --repeats 2 --compile --keep-gathered --layouts shared_base_adapters --batch 8 \
        --sdpa-backend $backend --json "$out/phases_shared_batch8_$backend.json"
    done
    ;;
  *)
    echo "bench_gpu.sh: unknown benchmark '$what' (offload, phases, check or attention)" >&2
    exit 2
    ;;
esac
