"""The batched step's group kernels on the GPU: ``kernels.pack_group`` and ``kernels.decode_group`` of one fusion
group, timed as a ratio to ``torch.clone`` of the group's float32 bytes (one flat tensor), and the reads back to
the host (``safebits_hvd.codec.host``) per group. Run: ``SAFEBITS_BENCH_DEVICE=cuda python -m bench.suites.bench_group``
(bench/gpu_check.sh does). Groups: many small tensors (a transformer layer's biases and norms), and a few large."""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from bench.suites.bench_kernels import best_time  # the suites' timer
from safebits_hvd.codec import host
from safebits_hvd.codec import kernels as K
from safebits_hvd.codec.actions import DEFAULT_MENU, make_menu
from safebits_hvd.codec.rng import stream_key
from safebits_hvd.policy.budget import BudgetPolicy
from safebits_hvd.policy.screen import ScreenRule

DEVICE = os.environ.get("SAFEBITS_BENCH_DEVICE", "cpu")
MENU = make_menu(DEFAULT_MENU)
GROUPS = {"256 x 256": np.full(256, 256), "64 x 1024 + 64 x 16": np.array([1024, 16] * 64),
          "16 x 1M": np.full(16, 1 << 20)}
SAMPLE_BUCKETS = 16
RANKS = 4


def run(name: str, sizes: np.ndarray) -> None:
    m = len(sizes)
    policy = BudgetPolicy(MENU, sizes, 0.5, 0.7)
    tables = K.GroupTables(MENU, sizes, policy.cost_order)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(int(n), generator=gen).to(DEVICE) for n in sizes]
    residuals = [torch.zeros(int(n), device=DEVICE) for n in sizes]
    sents = [torch.empty(int(n), device=DEVICE) for n in sizes]
    samples = []
    for n in sizes:
        nb = -(-int(n) // MENU.bucket_size)
        samples.append(None if nb <= SAMPLE_BUCKETS else
                       torch.linspace(0, nb - 1, SAMPLE_BUCKETS).long().unique().to(DEVICE))
    keys = np.array([stream_key(0, 1, k) for k in range(m)], dtype=np.uint32)
    allocated = np.random.RandomState(0).randint(0, len(MENU), m)
    request = K.PackRequest(np.arange(m), grads, residuals, sents, samples, keys, allocated, True, True, True,
                          ScreenRule(0.5, 0.7))
    flat = torch.randn(int(sizes.sum()), generator=gen).to(DEVICE)
    t_clone = best_time(lambda: flat.clone())
    result = K.pack_group(request, tables)
    before = host.reads()
    t_send = best_time(lambda: K.pack_group(request, tables))
    send_reads = (host.reads() - before) / 8            # best_time: one warm-up call + 7 timed ones
    # every rank sent this rank's payloads (the decode work of a RANKS-rank allgather)
    payloads = [[result.buffer[result.offsets[k]:result.offsets[k + 1]]] * RANKS for k in range(m)]
    actions = np.repeat(result.chosen[:, None], RANKS, axis=1)
    outs = [torch.empty(int(n), device=DEVICE) for n in sizes]
    own = np.full(m, -1)
    names = [f"t{k}" for k in range(m)]
    before = host.reads()
    t_decode = best_time(lambda: K.decode_group(payloads, actions, outs, own, tables, np.arange(m), names, RANKS))
    decode_reads = (host.reads() - before) / 8
    print(f"group {name:>20}: {sizes.sum():>9} floats  clone={t_clone * 1e3:7.3f} ms  "
          f"send_group={t_send / t_clone:6.2f}x clone ({send_reads:.0f} host reads/group)  "
          f"decode_group({RANKS} ranks)={t_decode / t_clone:6.2f}x clone ({decode_reads:.0f} host reads/group)",
          flush=True)


if __name__ == "__main__":
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("SAFEBITS_BENCH_DEVICE=cuda but no CUDA device")
    for group_name, group_sizes in GROUPS.items():
        run(group_name, group_sizes)
