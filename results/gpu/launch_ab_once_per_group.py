"""Paired A/B in one process: the SafeBits GPU step with the launcher of f4833ce (device entered, stream looked up per
launch) against the working tree's (once per group); steps alternate. Plus the host time of one launch each way."""
import contextlib
import statistics
import time

import numpy as np
import torch
from cupy.cuda import Device

from bench.experiments.step_profile import model_sizes
from bench.suites import bench_step
from safebits_hvd.kernels import cuda

new_launcher = cuda._launcher


@contextlib.contextmanager
def old_launcher(device):
    index = device.index if device.index is not None else torch.cuda.current_device()

    def launch(name, grid, args):
        with Device(index):
            cuda._function(name, index)((grid,), (cuda.THREADS,), args,
                                        stream=cuda._Stream(torch.cuda.current_stream(device).cuda_stream))
    yield launch


dev = torch.device("cuda", 0)
buf = torch.zeros(16, dtype=torch.uint8, device=dev)
off = torch.zeros(2, dtype=torch.int64, device=dev)
args = (np.int32(0), cuda._ptr(off), cuda._ptr(off), np.int32(0), cuda._ptr(off), cuda._ptr(buf), np.int64(0))
for label, maker in (("old", old_launcher), ("new", new_launcher), ("old", old_launcher), ("new", new_launcher)):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        with maker(dev) as launch:
            for _ in range(10):
                launch("sb_gather_kernel", 1, args)
    host = (time.perf_counter() - start) / 2000
    torch.cuda.synchronize()
    print(f"launch host time, {label}: {host * 1e6:.1f} us (200 groups of 10 launches)", flush=True)

for model, sizes in (("resnet18", model_sizes("resnet18")), ("gpt2_small", model_sizes("gpt2_small")),
                     ("1000x16", [16] * 1000)):
    _, step, _ = bench_step.make_step(sizes, "allgather", 4.4)
    times = {"old": [], "new": []}
    for i in range(46):
        label = ("old", "new")[i % 2] if (i // 2) % 2 == 0 else ("new", "old")[i % 2]
        cuda._launcher = old_launcher if label == "old" else new_launcher
        start = time.perf_counter()
        step()
        if i >= 6:
            times[label].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{model}: old {med['old']:.1f} ms, new {med['new']:.1f} ms, new/old {med['new'] / med['old']:.3f} "
          f"({len(times['old'])} steps each, alternating)", flush=True)
