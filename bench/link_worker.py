"""One Horovod rank of the link benchmark (launched by ``bench/link.py`` inside a network namespace).

What it measures: for every (model, compressor) case, one after another in the same two processes, the wall time
of each training step, the bytes that crossed the namespace's loopback during the timed steps (rank 0 reads
``/sys/class/net/lo/statistics/tx_bytes`` before and after; both ranks talk over that one ``lo``, so the delta
covers both ranks' traffic, TCP/IP headers and Horovod's own coordination included), the bytes the compressor
says it put on the wire (``StepRecord.wire_bytes`` where the record carries it, summed over ranks) and the modeled
bytes (``StepRecord.modeled_bits_total``, else ``used_bits_total``; 4 or 2 bytes per parameter for Horovod's
``none`` and ``fp16``).

Models: ``resnet18`` (a CIFAR-style ResNet-18 in plain torch on synthetic 3xSxS images, ``--image-size`` S = 32 by
default, 10 classes, SGD with momentum; batch ``--cnn-batch``), ``gpt2_small`` (a GPT-2-shaped decoder, 12 layers,
width 256, 11.6M parameters in 148 tensors, on synthetic token ids, next-token loss, AdamW; ``--gpt-batch``
sequences of 128 tokens), both from ``bench/link_models.py`` (shared with the DDP worker), and ``bytes_lm`` (the
demo's byte-level transformer LM and data, from ``bench/demo_worker.py``; ``--lm-batch``). Every case records its
model's parameter and tensor counts, the throughput unit (images, tokens or sequences) and the input shape.
Compressors: ``none`` and ``fp16`` are ``hvd.Compression.none`` / ``hvd.Compression.fp16``; any other name is a
:func:`safebits_hvd.baselines.make_compressor` name, ``name@bits`` giving ``budget_bits`` (``safebits@4.4``,
``safebits@auto``).

Every case builds its model from the same seed, broadcasts it from rank 0, wraps a fresh optimizer in
``hvd.DistributedOptimizer``, runs ``--warmup`` untimed steps, a barrier, then ``--steps`` timed steps and a
barrier. Before the cases, a link probe times plain fp32 allreduces (no model, no compressor) and divides the
loopback bytes they moved by their time: the rate the link really gave. Rank 0 writes the raw figures to
``--out`` (JSON). Not meant to be run by hand; see ``bench/link.py``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import itertools
import json
import logging
import os
import platform
import statistics
import sys
import time
from typing import Any

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from link_models import DEFAULT_IMAGE_SIZE, SharedWorkload, model_facts

from safebits_hvd.baselines import BUDGETED, make_compressor

TX_BYTES = "/sys/class/net/lo/statistics/tx_bytes"
SEED = 0


# ---------------------------------------------------------------------------------------------- models
class Workload:
    """A model factory, its optimizer, a per-rank batch and the loss of one step: ``resnet18`` and
    ``gpt2_small`` from :mod:`link_models` (shared with the DDP worker), ``bytes_lm`` from the demo."""

    NAMES = (*SharedWorkload.NAMES, "bytes_lm")

    def __init__(self, name: str, batch: int, image_size: int = DEFAULT_IMAGE_SIZE) -> None:
        self.name = name
        self.batch = batch
        self.lm: Any = None
        self.shared: SharedWorkload | None = None
        if name == "bytes_lm":
            from demo_worker import make_task  # the demo's LM, corpus and optimizer

            self.lm = make_task("bytes_lm", steps=0)
            self.lm.batch = batch
        else:
            self.shared = SharedWorkload(name, batch, image_size)      # raises on an unknown name

    def model(self) -> torch.nn.Module:
        return self.lm.model() if self.shared is None else self.shared.model()

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return self.lm.optimizer(model) if self.shared is None else self.shared.optimizer(model)

    def loss(self, model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
        return self.lm.batch_loss(model, gen) if self.shared is None else self.shared.loss(model, gen)

    def facts(self) -> dict[str, Any]:
        """Throughput unit and input shape (see :meth:`link_models.SharedWorkload.facts`); ``bytes_lm`` counts
        sequences (windows of bytes)."""
        if self.shared is not None:
            return self.shared.facts()
        return {"unit": "sequences", "unit_per_sample": 1, "image_size": None, "seq_len": None, "vocab": None}


# ---------------------------------------------------------------------------------------------- one case
def read_tx_bytes() -> int:
    with open(TX_BYTES, encoding="ascii") as f:
        return int(f.read())


def build_compression(label: str, model: torch.nn.Module, case_id: int) -> Any:
    """Horovod's ``none`` / ``fp16`` or a registry compressor (``name`` or ``name@budget_bits``)."""
    if label == "none":
        return hvd.Compression.none
    if label == "fp16":
        return hvd.Compression.fp16
    name, _, budget = label.partition("@")
    kwargs: dict[str, Any] = {"name": f"safebits.link.{case_id}"} if name in BUDGETED else {}
    bits: float | str | None = budget if budget == "auto" else float(budget) if budget else None
    return make_compressor(name, model.named_parameters(), seed=SEED, budget_bits=bits, **kwargs)


def barrier(tag: str) -> None:
    hvd.allreduce(torch.zeros(1), name=f"link.barrier.{tag}")


def train_step(work: Workload, model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    opt.zero_grad()
    work.loss(model, gen).backward()
    opt.step()


def run_case(work: Workload, label: str, case_id: int, warmup: int, steps: int) -> dict[str, Any]:
    """Warm-up steps, then timed steps between two barriers; the raw figures of one case (meaningful on rank 0)."""
    torch.manual_seed(SEED)
    model = work.model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    facts = model_facts(model)
    params = facts["parameters"]
    compression = build_compression(label, model, case_id)
    opt = hvd.DistributedOptimizer(work.optimizer(model), named_parameters=model.named_parameters(),
                                   compression=compression)
    gen = torch.Generator().manual_seed(SEED * 7919 + hvd.rank())
    for _ in range(warmup):
        train_step(work, model, opt, gen)
    barrier(f"{case_id}.start")
    tx0 = read_tx_bytes()
    start = time.perf_counter()
    step_times: list[float] = []
    wire: list[float | None] = []
    modeled_bits: list[float] = []
    collective: str | None = None
    violations = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step(work, model, opt, gen)
        step_times.append(time.perf_counter() - t0)
        record = getattr(compression, "last_step", None)
        if record is None:            # Horovod's own compressors: no record; the dtype says it all
            modeled_bits.append((16 if label == "fp16" else 32) * params)
            wire.append(None)
            continue
        wire_bytes = getattr(record, "wire_bytes", None)
        wire.append(None if wire_bytes is None else float(wire_bytes))
        modeled = getattr(record, "modeled_bits_total", None)
        modeled_bits.append(float(record.used_bits_total if modeled is None else modeled))
        collective = getattr(record, "collective", None) or collective
        violations += int(bool(getattr(record, "violation", False)))
    barrier(f"{case_id}.end")
    elapsed = time.perf_counter() - start
    tx1 = read_tx_bytes()
    wire_total: float | None = None
    if all(w is not None for w in wire):          # this rank's bytes, summed over steps, then over ranks
        wire_total = float(hvd.allreduce(torch.tensor([sum(w for w in wire if w is not None)], dtype=torch.float64),
                                         op=hvd.Sum, name=f"link.wire.{case_id}"))
    # Every rank's record is identical under Horovod (reduced across ranks): the total is size x one rank's.
    modeled_bytes_per_step = hvd.size() * statistics.fmean(modeled_bits) / 8
    result = {
        "model": work.name, "compressor": label, **facts, **work.facts(), "batch_per_rank": work.batch,
        "ranks": hvd.size(), "warmup": warmup, "steps": steps, "step_times_s": step_times,
        "elapsed_s": elapsed, "link_bytes": tx1 - tx0, "wire_bytes_total": wire_total,
        "modeled_bytes_per_step": modeled_bytes_per_step, "modeled_bits_per_rank": modeled_bits,
        "collective": collective, "violations": violations,
    }
    del opt, model, compression
    gc.collect()
    return result


def link_probe(elements: int = 4 * 2**20, repeats: int = 3) -> dict[str, Any]:
    """Communication alone: fp32 allreduces of ``elements`` values (no model, no compressor). The loopback bytes
    they move over their median time is the rate the link really gave, a check that the limit is in place."""
    x = torch.ones(elements)
    hvd.allreduce(x, name="link.probe.warm")
    times, moved = [], []
    for k in range(repeats):
        barrier(f"probe.{k}")
        tx0, t0 = read_tx_bytes(), time.perf_counter()
        hvd.allreduce(x, name="link.probe")
        times.append(time.perf_counter() - t0)
        moved.append(read_tx_bytes() - tx0)
    median = statistics.median(times)
    return {"elements": elements, "times_s": times, "link_bytes": moved,
            "achieved_bits_per_s": statistics.median(moved) * 8 / median if median > 0 else None}


def batch_for(name: str, args: argparse.Namespace) -> int:
    """The per-rank batch of ``name``: ``--cnn-batch``, ``--gpt-batch`` or ``--lm-batch``."""
    return {"resnet18": args.cnn_batch, "gpt2_small": args.gpt_batch}.get(name, args.lm_batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="raw results JSON (written by rank 0)")
    parser.add_argument("--models", nargs="+", default=["resnet18", "bytes_lm"], choices=Workload.NAMES)
    parser.add_argument("--compressors", nargs="+", required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="times the compressor list runs, in turn")
    parser.add_argument("--cnn-batch", type=int, default=16)
    parser.add_argument("--lm-batch", type=int, default=16, help="bytes_lm sequences per rank")
    parser.add_argument("--gpt-batch", type=int, default=8, help="gpt2_small sequences (128 tokens) per rank")
    parser.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE, help="ResNet-18 image side")
    args = parser.parse_args()

    torch.set_num_threads(1)
    logging.getLogger("safebits_hvd").setLevel(logging.ERROR)   # violations are counted per case
    hvd.init()
    rank0 = hvd.rank() == 0
    probe = link_probe()
    if rank0:
        print(f"[link] probe: fp32 allreduce of {probe['elements']:,} values moved "
              f"{statistics.median(probe['link_bytes']) / 1e6:.1f} MB in {statistics.median(probe['times_s']):.3f} s "
              f"= {probe['achieved_bits_per_s'] / 1e9:.2f} Gbit/s on the link", flush=True)
    cases = []
    case_id = 0
    for name in args.models:
        work = Workload(name, batch_for(name, args), args.image_size)
        for round_index, label in itertools.product(range(args.rounds), args.compressors):
            result = run_case(work, label, case_id, args.warmup, args.steps)
            result["round"] = round_index
            case_id += 1
            cases.append(result)
            if rank0:
                median = statistics.median(result["step_times_s"])
                rate = result["ranks"] * work.batch * result["unit_per_sample"] / median
                print(f"[link] {name:10s} {label:13s} step {median * 1e3:8.1f} ms  {rate:9.2f} {result['unit']}/s  "
                      f"link {result['link_bytes'] / result['steps'] / 1e6:8.2f} MB/step  "
                      f"modeled {result['modeled_bytes_per_step'] / 1e6:8.2f} MB/step", flush=True)
    if rank0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"cases": cases, "probe": probe, "torch": torch.__version__,
                       "horovod": importlib.metadata.version("horovod"), "threads": torch.get_num_threads(),
                       "python": platform.python_version()}, f)


if __name__ == "__main__":
    main()
