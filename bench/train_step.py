"""A real training step under DDP in one process (world size 1: DDP still hands every bucket to its communication
hook, so the hook does all its work), the hooks a user would compare side by side: DDP's default all-reduce,
``bf16_compress_hook``, ``powerSGD_hook`` at rank 4, and SafeBits at 4.4 bits and ``auto`` (allgather path, so the
pack and decode run). On a GPU: NCCL, bf16 autocast, GPT-2 small (Hugging Face ``transformers``) and ResNet-50
(``torchvision``) from configs, no weights. ``--tiny`` runs small models of ``bench/tasks.py`` on the CPU with Gloo
(what the tests run; ``fp16_compress_hook`` stands in for the bf16 one, which DDP takes on NCCL only). Prints, per
model and hook, the median step (forward, backward with the hook, optimizer) and its ratio to the default hook's,
measured in turns (``--rounds``) in one process; ``--json`` writes them.

    python -m bench.train_step --models gpt2_small resnet50 --json results/gpu/train_step.json     # on a GPU
    .venv/bin/python -m bench.train_step --tiny --steps 3 --warmup 1                                  # CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from safebits_hvd import ddp as sbddp

from . import tasks

HOOKS = ("default", "bf16_compress", "powersgd_rank4", "safebits@4.4", "safebits@auto")


Loss = Callable[[torch.nn.Module], torch.Tensor]
"""One step's loss on a fixed synthetic batch, through the model given (the DDP wrapper, so that its hook runs)."""


def build(model: str, tiny: bool, device: torch.device) -> tuple[torch.nn.Module, Loss]:
    """The model and its :data:`Loss`."""
    gen = torch.Generator().manual_seed(0)
    if model == "gpt2_small":
        if tiny:
            cfg = tasks.GPTConfig(layers=2, width=64, heads=2, vocab=512, context=32, mlp=256)
            net: torch.nn.Module = tasks.GPT2(cfg)
            ids = tasks.token_batch(2, gen, cfg).to(device)
            return net.to(device), lambda wrapped: tasks.next_token_loss(wrapped, ids)
        from transformers import GPT2Config, GPT2LMHeadModel

        net = GPT2LMHeadModel(GPT2Config())           # 124M parameters, GPT-2 small's shape
        ids = torch.randint(50257, (8, 1024), generator=gen).to(device)
        return net.to(device), lambda wrapped: wrapped(input_ids=ids, labels=ids).loss
    if model == "resnet50":
        if tiny:
            net = tasks.ResNet18()
            x, y = tasks.image_batch(4, 16, gen)
        else:
            import torchvision

            net = torchvision.models.resnet50()
            x, y = torch.randn(64, 3, 224, 224, generator=gen), torch.randint(1000, (64,), generator=gen)
        x, y = x.to(device), y.to(device)
        return net.to(device), lambda wrapped: F.cross_entropy(wrapped(x), y)
    raise ValueError(f"unknown model {model!r}")


def register(model: DistributedDataParallel, hook: str) -> Any:
    """Register ``hook`` on ``model``; returns its state (SafeBits': to read records)."""
    if hook == "default":
        return None
    if hook == "bf16_compress":      # DDP takes it on NCCL only: on the CPU (--tiny) its fp16 twin stands in
        cast = default_hooks.bf16_compress_hook if dist.get_backend() == "nccl" else default_hooks.fp16_compress_hook
        model.register_comm_hook(None, cast)
        return None
    if hook == "powersgd_rank4":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    budget: float | str = "auto" if hook == "safebits@auto" else float(hook.split("@")[1])
    state = sbddp.SafeBitsState(model.module.named_parameters(), budget_bits=budget, collective="allgather",
                                name=f"train_step.{hook}")
    model.register_comm_hook(state, sbddp.safebits_hook)
    return state


def time_steps(net: torch.nn.Module, loss_of: Loss, device: torch.device, hook: str,
               steps: int, warmup: int) -> list[float]:
    """Seconds of each timed step of ``net`` wrapped in DDP with ``hook`` (a fresh wrapper and optimizer)."""
    model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    state = register(model, hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    times = []
    for step in range(warmup + steps):
        sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_of(model)
        loss.backward()
        optimizer.step()
        sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    if not torch.isfinite(loss.detach()).all():
        raise RuntimeError(f"{hook}: the loss is not finite")
    if isinstance(state, sbddp.SafeBitsState) and (state.last_step is None or state.step != warmup + steps):
        raise RuntimeError(f"{hook}: DDP did not run the hook every step ({state.step} of {warmup + steps})")
    return times


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2_small", "resnet50"], choices=["gpt2_small", "resnet50"])
    parser.add_argument("--hooks", nargs="+", default=list(HOOKS), choices=HOOKS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="turns over the hooks (ratios within one run)")
    parser.add_argument("--tiny", action="store_true", help="small models on the CPU with Gloo")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda:0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    rows = []
    try:
        for model in args.models:
            net, loss_of = build(model, args.tiny, device)
            times: dict[str, list[float]] = {hook: [] for hook in args.hooks}
            for _ in range(args.rounds):
                for hook in args.hooks:
                    times[hook] += time_steps(net, loss_of, device, hook, args.steps, args.warmup)
            base = statistics.median(times[args.hooks[0]])
            for hook in args.hooks:
                median = statistics.median(times[hook])
                rows.append({"model": model + (" (tiny)" if args.tiny else ""), "hook": hook, "device": str(device),
                             "median_ms": 1e3 * median, f"vs_{args.hooks[0]}": median / base,
                             "steps": len(times[hook])})
    finally:
        dist.destroy_process_group()
    print(f"| model | hook | median step, ms | x {args.hooks[0]} |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['model']} | {row['hook']} | {row['median_ms']:.2f} | {row[f'vs_{args.hooks[0]}']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
