#!/usr/bin/env bash
# The Python packages the lent GPU machine lacks (it has torch, transformers, peft, numpy ...; no registry),
# downloaded here as cp312 manylinux wheels for DEVELOPERS.md's procedure:
#   bash scripts/gpu_wheels.sh        # -> .whl/ (about 30 MB) and .whl_ray/part_a|part_b (ray, split in two)
# Each run call carries at most 64 MiB with the working tree: .whl + part_a in one call, part_b in the next.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
py="${PYTHON:-python3}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.whl_ray/' .git/info/exclude 2>/dev/null || echo '/.whl_ray/' >> .git/info/exclude
rm -rf .whl .whl_ray && mkdir -p .whl .whl_ray/part_a .whl_ray/part_b
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64)
get() { "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          "${platforms[@]}" -d "$1" "${@:2}"; }
# The project's own needs at the versions of its local environment; then verl's, hydra's and ray[default]'s
# dependencies that the machine does not have (checked against its package list, 2026-12-03).
get .whl diffusers==0.42.1 verl==0.9.1 hydra-core==1.3.8 omegaconf==2.3.1 \
  codetiming==1.4.0 datasets==5.2.0 dill==0.4.1 pylatexenc==2.11 torchdata==0.11.0 multiprocess==0.70.19 \
  tensordict==0.10.0 orjson==3.13.0 pyvers==0.1.0 importlib_metadata==10.2.0 lazy_importer==0.1.0 \
  cachetools==8.0.2 uvicorn==0.55.0 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 referencing==0.37.0 \
  rpds_py==2026.9.1 aiohttp_cors==0.8.1 colorful==0.5.8 py_spy==0.4.3 smart_open==9.0.4 pydantic==2.14.4 \
  pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 opencensus==0.11.4 \
  opencensus_context==0.1.3 google_api_core==2.44.0 google_auth==2.63.0 googleapis_common_protos==1.76.0 \
  proto_plus==1.29.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pyasn1==0.6.5 pyasn1_modules==0.4.2 \
  opentelemetry_api==1.45.2 opentelemetry_sdk==1.45.2 opentelemetry_proto==1.45.2 \
  opentelemetry_semantic_conventions==0.66b2 opentelemetry_exporter_prometheus==0.66b2 virtualenv==21.14.5 \
  distlib==0.4.4 platformdirs==4.14.9 python_discovery==1.9.7
# antlr4 4.9.3 (hydra's pin) is published as a source distribution only: build its pure-Python wheel.
"$py" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
get .whl_ray ray==2.60.0
wheel="$(cd .whl_ray && ls ray-*.whl)"
# the split point: .whl + part_a and part_b each fit one call beside the working tree (about 10.6 MB on
# 2026-12-07: 61.9 and 62.4 MiB of the 64)
head -c 24500000 ".whl_ray/$wheel" > .whl_ray/part_a/ray.whl.partaa
tail -c +24500001 ".whl_ray/$wheel" > .whl_ray/part_b/ray.whl.partab
echo "$wheel" | tee .whl_ray/part_a/NAME > .whl_ray/part_b/NAME
rm ".whl_ray/$wheel"
du -sh .whl .whl_ray/part_a .whl_ray/part_b
