#!/usr/bin/env bash
# Run the CUDA paths (pinned staging on a side stream) on a GPU machine, and
# measure staging against the device-to-host roofline (benchmarks/staging.py).
# Needs the test environment of the README; takes about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
"$PY" -m pytest -q -rs tests/test_checkpointer.py tests/test_torchtitan.py -k cuda
PYTHONPATH=. "$PY" -m benchmarks.staging --json "${OUT:-.}/staging.json"
