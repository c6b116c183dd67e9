"""Accelerate worker: SafeBits' DDP hook on the model ``Accelerator.prepare`` wrapped (Gloo, CPU, 2 ranks).

Run as ``torchrun --nproc_per_node 2 trainer_tests/accelerate_worker.py --out DIR``. ``Accelerator(cpu=True)``
initializes the process group (Gloo on CPU) and ``prepare`` wraps the model in ``DistributedDataParallel``; the
hook is registered on that model (Accelerate's ``DistributedDataParallelKwargs(comm_hook=)`` takes only PyTorch's
built-in hooks). Each rank trains ``STEPS`` steps, then writes ``DIR/rank<r>.json``: the loss on the whole data set
before and after, its parameters' SHA-256, SafeBits' figures, and the error raised when the same state is then
registered on a second model (a bad use: it must fail clearly on every rank, not hang).

``--no-hook`` skips the registration (the mutation check).
"""

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from workload import BUDGET_BITS, STEPS, digits, full_loss, mlp, params_digest

from safebits_hvd import ddp as sbddp
from safebits_hvd.frontends.launch import exit_without_finalization


def second_model_error(accelerator: Accelerator, state: sbddp.SafeBitsState, data: TensorDataset) -> str | None:
    """Register ``state`` on a second prepared model and run one backward: the error it raises (None: none)."""
    other = accelerator.prepare(mlp())
    other.register_comm_hook(state, sbddp.safebits_hook)
    x, y = data.tensors
    try:
        accelerator.backward(nn.functional.cross_entropy(other(x[:32]), y[:32]))
    except ValueError as exc:
        return str(exc)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-hook", action="store_true", help="do not register SafeBits (the mutation check)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    data = digits()
    model = mlp()
    loss_before = full_loss(model, data)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)      # loader: sharded per rank
    state = sbddp.SafeBitsState(model.named_parameters(), budget_bits=BUDGET_BITS)
    if not args.no_hook:
        model.register_comm_hook(state, sbddp.safebits_hook)
    model.train()
    steps = 0
    while steps < STEPS:
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            steps += 1
            if steps == STEPS:
                break
    unwrapped = accelerator.unwrap_model(model)
    record = state.last_step
    report: dict[str, Any] = {
        "backend": dist.get_backend(), "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type), "loss_before": loss_before,
        "loss_after": full_loss(unwrapped, data), "digest": params_digest(unwrapped), "safebits_steps": state.step,
        "records": len(state.history), "elements": sum(p.numel() for p in unwrapped.parameters()),
        "last_step": None if record is None else {
            "step": record.step, "wire_bytes": record.wire_bytes, "collective": record.collective,
            "modeled_compression_ratio": record.modeled_compression_ratio, "violation": record.violation}}
    accelerator.wait_for_everyone()
    report["second_model_error"] = second_model_error(accelerator, state, data)
    out = args.out / f"rank{accelerator.process_index}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"rank {accelerator.process_index} wrote {out}", flush=True)
    exit_without_finalization(0)


if __name__ == "__main__":
    main()
