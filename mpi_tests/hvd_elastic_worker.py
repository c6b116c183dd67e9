"""Horovod elastic worker: SafeBits under ``hvd.elastic.run`` while a worker is killed and another joins.

``mpi_tests/test_elastic.py`` launches it with ``horovodrun --gloo -np 3 --min-np 2 --max-np 3
--host-discovery-script D python mpi_tests/hvd_elastic_worker.py --hosts-file F``, where ``D`` prints the lines of
``F`` (``host:slots``). Every host name resolves to this machine (``localhost``, ``127.0.0.1``, the host name, its
address): Horovod blacklists the host of a worker that fails, so each worker needs a host of its own.

The training loop is Horovod's elastic recipe: ``hvd.elastic.TorchState(model, optimizer, compression=SafeBits,
batch=0)`` committed every ``--commit-every`` batches. At batch ``--kill-at`` the worker on ``--victim`` rewrites
``F`` (its host out, ``--joiner`` in) and kills itself with SIGKILL. The survivors' next collective fails, they
restore the last commit and go on with 2 workers (two-phase at 3 ranks, allgather at 2); the driver then starts a
worker on the joiner's host, which receives the state in ``state.sync()`` and trains with them to the end.

At the end every rank reports its parameter digest, SafeBits' step, the steps and collectives of its records and
the world sizes it trained in; rank 0 checks that they agree and prints ``PASS elastic ...`` or ``FAIL elastic
...``. ``--mutation NAME`` breaks the setup on purpose (see ``--help``) to check that the checks catch it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
from scenario_runner import ScenarioFailure, check, params_digest
from torch import nn

import safebits_hvd as sb

IN_FEATURES = 20
CLASSES = 4
BATCH = 64
MUTATIONS = ("none_compression", "no_state")


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``seed``: labels from a fixed linear teacher."""
    x = torch.randn(BATCH, IN_FEATURES, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(IN_FEATURES, CLASSES, generator=torch.Generator().manual_seed(12345))
    return x, (x @ w).argmax(dim=1)


def eval_loss(model: nn.Module) -> float:
    x, y = batch(999_999)
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts-file", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--victim", default="127.0.0.1")
    parser.add_argument("--joiner", required=True)
    parser.add_argument("--join-at", type=int, default=22)
    parser.add_argument("--mutation", default="", choices=("", *MUTATIONS),
                        help="none_compression: hvd.Compression.none (the reference run); no_state: SafeBits is "
                             "left out of TorchState")
    args = parser.parse_args()

    hvd.init()
    host = os.environ.get("HOROVOD_HOSTNAME", "")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN_FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, CLASSES))
    base = torch.optim.SGD(model.parameters(), lr=0.5)
    compression: Any = (hvd.Compression.none if args.mutation == "none_compression"
                        else sb.SafeBits(model.named_parameters(), budget_bits=4.4, timeout=60))
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression)
    tracked = {} if args.mutation in ("none_compression", "no_state") else {"compression": compression}
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, batch=0, **tracked)
    initial_size = hvd.size()
    worlds: list[int] = []           # the world size of every batch this process trained (rolled-back ones too)
    first_loss = eval_loss(model)

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.batch < args.steps:
            if state.batch == args.kill_at and host == args.victim:
                lines = [line for line in args.hosts_file.read_text().split() if not line.startswith(host + ":")]
                args.hosts_file.write_text("\n".join(lines) + "\n")
                print(f"killing the worker on {host} (rank {hvd.rank()}) at batch {state.batch}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if state.batch >= args.join_at and hvd.rank() == 0 and hvd.size() < initial_size:
                if f"{args.joiner}:1" not in args.hosts_file.read_text().split():
                    with args.hosts_file.open("a") as hosts:
                        hosts.write(f"{args.joiner}:1\n")
                time.sleep(0.25)         # let the joiner start before the batches run out
            worlds.append(hvd.size())
            x, y = batch(1000 * state.batch + hvd.rank())
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.batch += 1
            if state.batch % args.commit_every == 0:
                state.commit()

    train(state)
    mine: dict[str, Any] = {"host": host, "digest": params_digest(model), "worlds": worlds,
                            "loss": eval_loss(model)}
    if isinstance(compression, sb.SafeBits):
        mine.update(step=compression.step, records=[(r.step, r.collective) for r in compression.history])
    everyone = hvd.allgather_object(mine, name="elastic.results")
    if hvd.rank() != 0:
        return 0
    try:
        check(len({m["digest"] for m in everyone}) == 1, f"parameters differ across ranks: {everyone}")
        check(mine["loss"] < 0.8 * first_loss, f"loss did not fall: {first_loss:.3f} -> {mine['loss']:.3f}")
        hosts = sorted(m["host"] for m in everyone)
        check(args.victim not in hosts and args.joiner in hosts, f"the victim is still there or the joiner is not: "
                                                                  f"{hosts}")
        shrunk = worlds.index(min(worlds))
        check(min(worlds) < initial_size and max(worlds[shrunk:]) == initial_size,
              f"rank 0 did not train with fewer workers and then again with {initial_size}: {worlds}")
        if isinstance(compression, sb.SafeBits):
            check(all(m["step"] == args.steps for m in everyone),
                  f"SafeBits' step is not {args.steps} everywhere: {[m['step'] for m in everyone]}")
            steps = [s for s, _ in mine["records"]]
            check(steps == list(range(steps[0], args.steps)), f"rank 0's records skip or repeat steps: {steps}")
        info = {"hosts": hosts, "worlds": worlds, "loss": (first_loss, mine["loss"]),
                "collectives": sorted({c for _, c in mine.get("records", [])})}
        print(f"PASS elastic {info}", flush=True)
        return 0
    except ScenarioFailure as exc:
        print(f"FAIL elastic {exc}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
