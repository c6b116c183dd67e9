#!/usr/bin/env bash
# One short GPU check (run on a machine with a CUDA GPU, from the repo root): installs what is missing from
# PyPI, runs the GPU kernel tests (quantize_ef, screen, and the packed wire format: CUDA payloads byte-identical
# to the C ones, decode/decode_add; the group kernels of the batched step against the per-tensor ones), then prints
# the GPU kernel ratios to torch.clone, including the wire pack/decode_add ratios on 16M floats and the group
# kernels' (send_group, decode_group) with their host reads per group. About 2-5 minutes.
set -uo pipefail
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
need=()
$PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || need+=(torch)
$PY -c "import cupy" 2>/dev/null || need+=(cupy-cuda12x nvidia-cuda-nvrtc-cu12)
$PY -c "import pytest" 2>/dev/null || need+=(pytest)
$PY -c "import pytest_benchmark" 2>/dev/null || need+=(pytest-benchmark)
if [ ${#need[@]} -gt 0 ]; then echo "installing: ${need[*]}"; $PY -m pip install -q "${need[@]}" || exit 1; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
echo "== GPU tests"
SAFEBITS_REQUIRE_NVRTC=1 timeout 240 $PY -m pytest tests/test_cuda_kernels.py -q -x -p no:cacheprovider
rc=$?
echo "== GPU wire benchmarks (pytest-benchmark: pack and decode_add of 16M floats)"
SAFEBITS_BENCH_DEVICE=cuda timeout 120 $PY -m pytest bench/suites/bench_kernels.py -q -p no:cacheprovider \
  --benchmark-enable -k "quantize_pack_ef or decode_add" --benchmark-columns=min,mean || rc=1
echo "== GPU group kernels (the batched step's tests, then time / torch.clone of the group's bytes, host reads)"
SAFEBITS_REQUIRE_NVRTC=1 timeout 120 $PY -m pytest tests/test_cuda_kernels.py -q -p no:cacheprovider \
  -k "group or nvrtc" || rc=1
SAFEBITS_BENCH_DEVICE=cuda timeout 120 $PY -m bench.suites.bench_group || rc=1
echo "== GPU kernel ratios (kernel time / torch.clone, same process)"
SAFEBITS_BENCH_DEVICE=cuda timeout 120 $PY -m bench.suites.bench_kernels
exit $rc
