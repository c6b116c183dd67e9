"""The smallest complete example of SafeBits with Horovod: an MLP on scikit-learn's bundled digits.

    horovodrun -np 2 python examples/train_digits.py [--epochs 5] [--budget-bits 4.0|auto]

Every rank trains on its own shard of the training set; ``SafeBits`` is the ``compression=`` of Horovod's stock
``hvd.DistributedOptimizer``. Rank 0 prints, per epoch, the training loss (averaged over ranks), the test accuracy
and SafeBits' figures: median modeled compression ratio, budget violations, escalations, and the bytes this rank
put on the wire per step.
"""

from __future__ import annotations

import argparse
import statistics

import horovod.torch as hvd
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import safebits_hvd as sb


def main() -> None:
    parser = argparse.ArgumentParser(description="SafeBits + Horovod on the scikit-learn digits")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--budget-bits", type=lambda x: x if x == "auto" else float(x), default=4.0,
                        help="average bits per parameter per step, or 'auto'")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]   # this rank's shard

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    compression = sb.SafeBits(model.named_parameters(), budget_bits=args.budget_bits)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Same number of steps on every rank (every rank must take part in every step's allreduces).
    steps_per_epoch = hvd.allreduce(torch.tensor(len(x_train) // args.batch_size), op=hvd.Min,
                                    name="steps_per_epoch").item()
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch + 100 * hvd.rank()))
        losses = []
        first_record = len(compression.history)
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        mean_loss = hvd.allreduce(torch.tensor(statistics.fmean(losses)), name="epoch_loss").item()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        records = compression.history[first_record:]
        ratio = statistics.median(r.modeled_compression_ratio for r in records)
        violations = sum(r.violation for r in records)
        escalations = sum(len(r.escalations) for r in records)
        wire_kb = statistics.median(r.wire_bytes for r in records) / 1e3
        if hvd.rank() == 0:
            print(f"epoch {epoch}  loss {mean_loss:.4f}  test accuracy {accuracy:.3f}  SafeBits: compression "
                  f"ratio {ratio:.2f}x, {violations} budget violations and {escalations} escalations "
                  f"in {len(records)} steps, {wire_kb:.1f} kB on the wire per step ({records[-1].collective})",
                  flush=True)


if __name__ == "__main__":
    main()
