#!/usr/bin/env bash
# The CUDA paths on a GPU machine: tests/test_gpu.py (the copies held back by a
# sleep on the side stream, so their order is known: overlap, overwrites, two
# saves in flight, planner temporaries under allocation churn, non-default
# streams for async and plain dcp.save, odd dtypes and shapes, DTensor, exact
# pinned memory, no context on GPU 0, loads into CUDA tensors bit-exact and a
# corrupt item kept off the GPU), the CUDA tests of the checkpointer and the
# torchtitan integration where their dependencies are installed, then staging
# and loading against the device-host rooflines (benchmarks/staging.py).
# Exits non-zero on any failure.  About two minutes on one GPU.
#
# Needs torch with CUDA, fsspec and pytest; not the project's .venv (a GPU
# machine has its own Python: PY=python3 by default when there is no .venv).
# The GPU tests write to file:// stores and need no S3 server, so they run
# without the test suite's conftest (moto, boto3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print("device:", torch.cuda.get_device_name(0), "x", torch.cuda.device_count(), "torch", torch.__version__)
PY
"$PY" -m pytest -q -rs -p no:cacheprovider --noconftest -o addopts="" tests/test_gpu.py
if "$PY" -c "import moto, boto3" 2>/dev/null; then
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_checkpointer.py tests/test_torchtitan.py -k cuda
else
  echo "skipping the S3-backed CUDA tests: moto and boto3 are not installed here"
fi
"$PY" -m benchmarks.staging --json "${OUT:-.}/staging.json"
