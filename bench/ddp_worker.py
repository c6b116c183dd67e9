"""One torchrun rank of the link benchmark's DDP rows (launched by ``bench.link`` inside its network namespace).

The same models, batches, link and figures as ``bench.hvd_worker link`` (the protocol of :mod:`bench.protocol`),
with ``torch.nn.parallel.DistributedDataParallel`` over Gloo and one communication hook per case. Models
(``--models``, from :mod:`bench.tasks`): ``resnet18`` (synthetic
3xSxS images, ``--image-size`` S, ``--cnn-batch``) and ``gpt2_small`` (synthetic token ids, ``--gpt-batch``
sequences of 128 tokens); every (model, round, compressor) is one case. Hooks:

* ``ddp:none``: DDP's default allreduce (no hook);
* ``ddp:fp16``: ``default_hooks.fp16_compress_hook``;
* ``ddp:powersgd1`` / ``ddp:powersgd4``: ``powerSGD_hook`` at rank 1 / 4 (error feedback and warm start on;
  PowerSGD starts after its one required uncompressed step, within the warm-up), completed inside the hook
  (:func:`powersgd_in_order`);
* ``ddp:safebits@B``: :func:`safebits_hvd.ddp.safebits_hook` at ``budget_bits=B`` (a number, or ``auto``).

With ``--quality-steps N`` it instead trains every case for N steps on a fixed learnable task (3x32x32 images
labelled by a fixed random teacher, 8 batches per rank, cycled) and reports the loss on a held-out set of the same
teacher (batch-norm on batch statistics): the short training run that compares compressors at their bytes
(ResNet-18 at 32x32 whatever ``--models`` and ``--image-size`` say). Not
meant to be run by hand.
"""

# No "from __future__ import annotations": DDP compares a hook's annotations with the real classes.

import argparse
import gc
import json
import logging
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from bench import specs
from bench.protocol import SEED, Case, pin_rank, read_tx_bytes, run_group, run_model, step_reporter
from bench.tasks import DEFAULT_IMAGE_SIZE, ResNet18, Workload, model_facts
from safebits_hvd import ddp as sbddp
from safebits_hvd.frontends.launch import exit_without_finalization

PSGD_START = 2          # PowerSGD needs one uncompressed step first (start_powerSGD_iter > 1 with error feedback)


def powersgd_modeled_bits(model: torch.nn.Module, rank: int, min_compression_rate: float = 2.0) -> float:
    """Bits one rank sends per step under PowerSGD at ``rank``: ``(n + m) r`` float32 per matrix it compresses
    (a tensor viewed as ``shape[0] x rest``, compressed when ``nm / ((n + m) r) >= min_compression_rate``), float32
    for the rest (as ``powerSGD_hook`` decides)."""
    floats = 0
    for p in model.parameters():
        if p.dim() > 1:
            n, m = p.shape[0], p.numel() // p.shape[0]
            r = min(n, m, rank)
            if n * m >= min_compression_rate * (n + m) * r:
                floats += (n + m) * r
                continue
        floats += p.numel()
    return 32.0 * floats


def powersgd_in_order(state: powerSGD_hook.PowerSGDState,
                      bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``powerSGD_hook``, completed before the hook returns. PowerSGD starts its second and third allreduce of a
    bucket from the callback of the previous one, on Gloo's worker threads; with several buckets in flight their
    order can differ between ranks, and Gloo then aborts on a size mismatch (seen in this benchmark). Waiting per
    bucket keeps every rank's order, at the price of PowerSGD's overlap with backward."""
    future = powerSGD_hook.powerSGD_hook(state, bucket)
    future.wait()
    return future


def attach(spec: specs.Spec, ddp_model: DistributedDataParallel, model: torch.nn.Module, case_id: int) -> Any:
    """Register ``spec``'s hook; returns the SafeBits state (None for the others) and the modeled bits."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if spec.name == "none":
        return None, 32.0 * params
    if spec.name == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None, 16.0 * params
    if spec.name.startswith("powersgd"):
        rank = int(spec.name.removeprefix("powersgd"))
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=PSGD_START,
                                            random_seed=SEED)
        ddp_model.register_comm_hook(state, powersgd_in_order)
        return None, powersgd_modeled_bits(model, rank)
    state = sbddp.SafeBitsState(model.named_parameters(), budget_bits=spec.budget_bits, seed=SEED,
                                name=f"safebits.ddp.{case_id}")
    ddp_model.register_comm_hook(state, sbddp.safebits_hook)
    return state, None


def barrier() -> None:
    dist.all_reduce(torch.zeros(1))


def training_step(work: Workload, ddp_model: DistributedDataParallel, opt: torch.optim.Optimizer,
                  gen: torch.Generator) -> Callable[[], None]:
    """One training step of ``ddp_model`` on ``work``'s next synthetic batch."""
    def step() -> None:
        opt.zero_grad()
        work.loss(ddp_model, gen).backward()
        opt.step()

    return step


def run_cases(work: Workload, plan: Sequence[tuple[int, specs.Spec]], warmup: int, steps: int,
              step_file: str | None = None) -> list[dict[str, Any]]:
    """The (case id, compressor) cases of ``plan`` on ``work`` under :func:`bench.protocol.run_group`, their
    timed steps interleaved when there are several; their JSON records (meaningful on rank 0)."""
    built = []
    for case_id, spec in plan:
        torch.manual_seed(SEED)
        model = work.model()
        ddp_model = DistributedDataParallel(model)
        state, fixed_bits = attach(spec, ddp_model, model, case_id)
        facts = model_facts(model)
        gen = torch.Generator().manual_seed(SEED * 7919 + dist.get_rank())
        warmup_steps = max(warmup, PSGD_START if spec.name.startswith("powersgd") else 0)
        built.append((case_id, spec, facts, Case(training_step(work, ddp_model, work.optimizer(model), gen),
                                                 partial(getattr, state, "history", None), fixed_bits, warmup_steps)))
    return run_group(work, built, barrier, warmup, steps, step_reporter(step_file, plan[0][0], dist.get_rank()),
                     dist.get_world_size(), sum_over_ranks)


def sum_over_ranks(value: float, case_id: int) -> float:
    """``value`` summed over the ranks (the default process group's all_reduce)."""
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0])


def teacher_batch(index: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of the quality task: images and the fixed teacher's labels (a random linear map of the
    4x4-pooled image)."""
    gen = torch.Generator().manual_seed(10_000 + index)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    w = torch.randn(3 * 4 * 4, 10, generator=torch.Generator().manual_seed(4242))
    return x, (F.adaptive_avg_pool2d(x, 4).flatten(1) @ w).argmax(dim=1)


def run_quality(spec: specs.Spec, case_id: int, batch: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps on the teacher task; the held-out loss and accuracy at the end, and the link bytes."""
    torch.manual_seed(SEED)
    model = ResNet18()
    ddp_model = DistributedDataParallel(model)
    state, fixed_bits = attach(spec, ddp_model, model, case_id)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)     # the timed cases' optimizer
    rank = dist.get_rank()
    data = [teacher_batch(8 * rank + k, batch) for k in range(8)]
    barrier()
    tx0 = read_tx_bytes()
    losses = []
    bits = []
    for step in range(steps):
        x, y = data[step % len(data)]
        opt.zero_grad()
        loss = F.cross_entropy(ddp_model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bits.append(fixed_bits if state is None else float(state.last_step.modeled_bits_total))
    barrier()
    tx1 = read_tx_bytes()
    # Batch statistics (train mode): 20-odd steps leave batch-norm's running statistics far from converged.
    with torch.no_grad():
        x, y = teacher_batch(99_999, 256)
        out = model(x)
        held_out = float(F.cross_entropy(out, y))
        accuracy = float((out.argmax(dim=1) == y).float().mean())
    result = {"compressor": spec.text, "steps": steps, "batch_per_rank": batch, "link_bytes": tx1 - tx0,
              "modeled_bytes_per_step": dist.get_world_size() * statistics.fmean(bits) / 8,
              "train_loss_last5": statistics.fmean(losses[-5:]), "train_loss_first": losses[0],
              "held_out_loss": held_out, "held_out_accuracy": accuracy}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="raw results JSON (written by rank 0)")
    parser.add_argument("--compressors", nargs="+", required=True, type=specs.argument, metavar="SPEC")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="times the compressor list runs, in turn")
    parser.add_argument("--interleave", action="store_true",
                        help="run each model's cases side by side, their timed steps alternating")
    parser.add_argument("--models", nargs="+", default=["resnet18"], choices=Workload.DDP_NAMES)
    parser.add_argument("--cnn-batch", type=int, default=16)
    parser.add_argument("--gpt-batch", type=int, default=8, help="gpt2_small sequences (128 tokens) per rank")
    parser.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE,
                        help="ResNet-18 image side of the timed cases (the training run stays at 32)")
    parser.add_argument("--quality-steps", type=int, default=0, help="train instead of timing (0: time)")
    parser.add_argument("--step-file", default=None,
                        help="rank 0 writes '<case> <step>' here before every step (the changing-link run)")
    args = parser.parse_args()
    if not all(spec.ddp for spec in args.compressors):
        parser.error("this worker runs ddp: specs only (ddp:none, ddp:fp16, ddp:powersgdR, ddp:safebits@BITS)")

    torch.set_num_threads(1)
    logging.getLogger("safebits_hvd").setLevel(logging.ERROR)   # violations are counted per case
    pin_rank()                 # before Gloo starts its threads: they inherit the binding
    dist.init_process_group("gloo")
    rank0 = dist.get_rank() == 0
    cases = []
    batches = {"resnet18": args.cnn_batch, "gpt2_small": args.gpt_batch}
    if args.quality_steps:
        for case_id, spec in enumerate(args.compressors):            # the training run: ResNet-18 only, once
            result = run_quality(spec, case_id, args.cnn_batch, args.quality_steps)
            if rank0:
                print(f"[link] quality {spec.text:17s} held-out loss {result['held_out_loss']:.4f} accuracy "
                      f"{result['held_out_accuracy']:.3f}  link {result['link_bytes'] / args.quality_steps / 1e6:.2f}"
                      f" MB/step", flush=True)
            result["round"] = 0
            cases.append(result)
            gc.collect()                  # the case's model, DDP wrapper and hook state
    else:
        for name in args.models:
            work = Workload(name, batches[name], args.image_size)
            cases += run_model(name, args.compressors, args.rounds, args.interleave, len(cases),
                               partial(run_cases, work, warmup=args.warmup, steps=args.steps,
                                       step_file=args.step_file), rank0)
    if rank0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"cases": cases, "torch": torch.__version__, "threads": torch.get_num_threads()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalization(0)
