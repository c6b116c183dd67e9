"""The smallest complete example of SafeBits with PyTorch DDP: an MLP on scikit-learn's bundled digits.

    torchrun --nproc_per_node 2 examples/train_digits_ddp.py [--epochs 5] [--budget-bits 4.0|auto]

Every rank trains on its own shard of the training set; SafeBits is DDP's communication hook
(``register_comm_hook(state, safebits_hook)``). Rank 0 prints, per epoch, the training loss (averaged over ranks),
the test accuracy and SafeBits' figures: median modeled compression ratio, budget violations, escalations, and the
bytes this rank put on the wire per step. The Horovod version is ``examples/train_digits.py``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from safebits_hvd import ddp as sbddp


def main() -> None:
    parser = argparse.ArgumentParser(description="SafeBits + PyTorch DDP on the scikit-learn digits")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--budget-bits", type=lambda x: x if x == "auto" else float(x), default=4.0,
                        help="average bits per parameter per step, or 'auto'")
    args = parser.parse_args()

    dist.init_process_group("gloo")                   # "nccl" on GPUs
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    x_train, y_train = x_train[rank::ranks], y_train[rank::ranks]            # this rank's shard

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp_model = DistributedDataParallel(model)        # broadcasts rank 0's parameters
    state = sbddp.SafeBitsState(ddp_model.named_parameters(), budget_bits=args.budget_bits)
    ddp_model.register_comm_hook(state, sbddp.safebits_hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr * ranks, momentum=0.9)

    # Same number of steps on every rank (every rank must take part in every step's collectives).
    steps = torch.tensor(len(x_train) // args.batch_size)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    for epoch in range(1, args.epochs + 1):
        ddp_model.train()
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch + 100 * rank))
        losses = []
        first_record = len(state.history)
        for step in range(int(steps)):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(ddp_model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        mean_loss = torch.tensor(statistics.fmean(losses))
        dist.all_reduce(mean_loss)
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        records = state.history[first_record:]
        ratio = statistics.median(r.modeled_compression_ratio for r in records)
        violations = sum(r.violation for r in records)
        escalations = sum(len(r.escalations) for r in records)
        wire_kb = statistics.median(r.wire_bytes for r in records) / 1e3
        if rank == 0:
            print(f"epoch {epoch}  loss {mean_loss.item() / ranks:.4f}  test accuracy {accuracy:.3f}  SafeBits: "
                  f"compression ratio {ratio:.2f}x, {violations} budget violations and {escalations} escalations "
                  f"in {len(records)} steps, {wire_kb:.1f} kB on the wire per step ({records[-1].collective})",
                  flush=True)
    # Every rank reaches the end before any tears its connections down (Gloo otherwise aborts a rank now and then,
    # "terminate called without an active exception", when its peer has already gone).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
