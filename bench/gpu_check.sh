#!/usr/bin/env bash
# One short GPU check (run on a machine with a CUDA GPU, from the repo root): installs what is missing from
# PyPI, runs the GPU kernel tests (quantize_ef, screen, and the packed wire format: CUDA payloads byte-identical
# to the C ones, decode/decode_add; the group kernels of the batched step against the per-tensor ones), then prints
# the GPU kernel ratios to torch.clone, including the wire pack/decode_add ratios on 16M floats and the group
# kernels' (send_group, decode_group) with their host reads per group, and the whole SafeBits step on the GPU
# (1,000 small tensors; ResNet-18's, ResNet-50's and GPT-2 small's gradients as on 2 ranks, host and step time apart)
# against torch.clone of the same gradients, with its
# reads back, launches and uploads per step (safebits_hvd.codec.host.counting), each kernel's registers and spills, and a
# real training step of GPT-2 small and ResNet-50 under DDP on the one GPU with each hook (bench/train_step.py).
# Each part has its own timeout, 8 minutes in all (installing what is missing aside; the earlier runs' times are in
# results/gpu/). Usage: bash bench/gpu_check.sh [folder for the JSON, default results/gpu]
set -uo pipefail
OUTDIR=${1:-results/gpu}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
need=()
$PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || need+=(torch)
$PY -c "import cupy" 2>/dev/null || need+=(cupy-cuda12x nvidia-cuda-nvrtc-cu12)
$PY -c "import pytest" 2>/dev/null || need+=(pytest)
$PY -c "import pytest_benchmark" 2>/dev/null || need+=(pytest-benchmark)
if [ ${#need[@]} -gt 0 ]; then echo "installing: ${need[*]}"; $PY -m pip install -q "${need[@]}" || exit 1; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
$PY -c "from safebits_hvd.codec import kernels; print('CPU kernels:', kernels.backend_name('cpu'))"
echo "== Kernel registers and spills (sm_90, NVRTC + ptxas)"
timeout 30 $PY -m safebits_hvd.codec.kernels.resources --arch sm_90 || rc_resources=1
echo "== GPU tests"
SAFEBITS_REQUIRE_NVRTC=1 timeout 100 $PY -m pytest tests/test_cuda_kernels.py -q --maxfail=5 -p no:cacheprovider
rc=$?
echo "== GPU step (the whole step in one process: step time / torch.clone of its gradients, reads back per step)"
SAFEBITS_BENCH_DEVICE=cuda timeout 90 $PY -m pytest bench/suites/bench_step.py -q -p no:cacheprovider \
  --benchmark-enable -k "thousand_tensor_step or model_step or pass_through" --benchmark-columns=min,median \
  --benchmark-json="$OUTDIR/gpu_step.json" || rc=1
$PY -c "import json, sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    print(b['name'], f\"{b['stats']['median'] * 1e3:.3f} ms\", b['extra_info'])" "$OUTDIR/gpu_step.json" || rc=1
echo "== GPU wire benchmarks (pytest-benchmark: pack and decode_add of 16M floats)"
SAFEBITS_BENCH_DEVICE=cuda timeout 50 $PY -m pytest bench/suites/bench_kernels.py -q -p no:cacheprovider \
  --benchmark-enable -k "quantize_pack_ef or decode_add" --benchmark-columns=min,mean || rc=1
echo "== GPU group kernels (time / torch.clone of the group's bytes, host reads)"
SAFEBITS_BENCH_DEVICE=cuda timeout 50 $PY -m bench.suites.bench_group || rc=1
echo "== One-GPU DDP training step (NCCL, world size 1, bf16 autocast): default, bf16, PowerSGD, SafeBits"
timeout 100 $PY -m bench.train_step --models gpt2_small resnet50 --steps 8 --warmup 2 --rounds 1 \
  --json "$OUTDIR/train_step.json" || rc=1
echo "== GPU kernel ratios (kernel time / torch.clone, same process)"
SAFEBITS_BENCH_DEVICE=cuda timeout 50 $PY -m bench.suites.bench_kernels
exit $(( rc || ${rc_resources:-0} ))
