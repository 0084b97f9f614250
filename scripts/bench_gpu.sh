#!/usr/bin/env bash
# The GPU benchmarks of docs/benchmarks.md in one place (one NVIDIA GPU, no ray).
#   bash scripts/bench_gpu.sh offload OUTDIR   # sleep/wake: both layouts, default vs packing/coalescing off (~6 min on an H200)
#   bash scripts/bench_gpu.sh phases OUTDIR    # DMD2 phases of SD3, compiled, kept gathered, bare loop (~8 min on an H200)
#   bash scripts/bench_gpu.sh phases128 OUTDIR [FAMILY...]  # the same for flux, qwen_image, wan (~5-7 min each)
#   bash scripts/bench_gpu.sh check OUTDIR     # sleep/wake before every phase trains bit for bit alike (~1 min)
#   bash scripts/bench_gpu.sh attention OUTDIR # the shared layout at batch 8 with each attention kernel (~7 min)
# Each run writes its JSON (and the profile) into OUTDIR; the tables print to stdout. The JSONs name the
# code ("code"): from git, or from VERL_DMD_COMMIT=<commit> where the copy has no .git (the lent machine).
set -euo pipefail
what="${1:?usage: bench_gpu.sh offload|phases|phases128|check|attention OUTDIR [FAMILY...]}"
out="${2:?usage: bench_gpu.sh offload|phases|phases128|check|attention OUTDIR [FAMILY...]}"
shift 2
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
    # --no-bare: the bare loop trains LoRA, not the full weights this layout trains (and saves a minute).
    $ph --layouts independent_full --batch 8 --no-bare --json "$out/phases_independent_full_batch8.json"
    ;;
  phases128)
    # The head-dim-128 families at their recipes' shapes (bench_phases.py's docstring): both layouts and the
    # bare loop, compiled, kept gathered, as `phases`; one process per family, each in one 10-minute call
    # (name the families to run after OUTDIR; default all three). Models are random init on the GPU.
    # Memory, estimated (saved activations counted on the meta device, eager, flash-like attention: 3.7 GiB
    # per SD3 sample, where `phases` measured 3.8): kept gathered on one GPU holds every model twice (its bf16
    # shards and the gathered copy), so the independent layout's student phase peaks at 6 x the bf16 weights
    # + the student's activations (the shared layout: 2 x weights + activations):
    #   flux: 11.9B (22.2 GiB bf16), 21.7 GiB per 1024 px sample: full size 133 + 43 GiB at batch 2 does not
    #     fit 139 GiB (nor batch 1, 155); 12 double + 24 single blocks (7.5B): 84 + 27 = ~114 GiB at batch 2.
    #   qwen_image: 20.4B (38.1 GiB), 41.9 GiB per 1328 px sample: full size 229 + 42 does not fit; 24 layers
    #     (8.2B): 92 + 17 = ~112 GiB at batch 1.
    #   wan: 1.4B (2.6 GiB), 73.7 GiB per 480x832x81 sample (32760 tokens): full size 16 + 74 = ~92 GiB at
    #     batch 1 (batch 2 would need ~166).
    # The shared layout alone fits flux and qwen_image at full size (~90 GiB at batch 2, ~122 GiB at batch 1):
    #   $py scripts/bench_phases.py --family flux --layouts shared_base_adapters --batch 2 --repeats 2 --compile --keep-gathered
    # Time on an H200 (1 warm-up cycle with compilation, 1 eager cycle counted, 2 timed, per layout; the bare
    # loop; 2 x 5 s of matmul rate): flux ~6 min (4.8 s cycles at 400 TFLOP/s), qwen_image ~5 min (3 s),
    # wan ~7 min (17 s cycles, attention over 32760 tokens).
    ph="$py $here/bench_phases.py --layouts shared_base_adapters independent --repeats 2 --bare-repeats 3 --compile"
    ph="$ph --keep-gathered"
    failed=""
    for family in ${@:-flux qwen_image wan}; do
      case "$family" in
        flux) shape="--layers 12 --batch 2" ;;
        qwen_image) shape="--layers 24 --batch 1" ;;
        wan) shape="--batch 1" ;;
        *) echo "bench_gpu.sh phases128: unknown family '$family' (flux, qwen_image or wan)" >&2; exit 2 ;;
      esac
      # A family that fails (out of memory, say) is named at the end; the others still run.
      $ph --family "$family" $shape --json "$out/phases128_$family.json" 2>&1 | tee "$out/phases128_$family.log" \
        || failed="$failed $family"
    done
    if [ -n "$failed" ]; then
      echo "bench_gpu.sh phases128: failed:$failed (see $out/phases128_<family>.log)" >&2
      exit 1
    fi
    ;;
  attention)
    for backend in cudnn flash efficient; do
      $py "$here/bench_phases.py" --repeats 2 --compile --keep-gathered --layouts shared_base_adapters --batch 8 \
        --no-bare --sdpa-backend $backend --json "$out/phases_shared_batch8_$backend.json"
    done
    ;;
  *)
    echo "bench_gpu.sh: unknown benchmark '$what' (offload, phases, phases128, check or attention)" >&2
    exit 2
    ;;
esac
