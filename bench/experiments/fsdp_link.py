"""FSDP2 on a rate-limited link: SafeBits' reduce-scatter (:mod:`safebits_hvd.fsdp`) against FSDP's own, in float32
and in bfloat16 (docs/RESULTS.md 3.4).

Two ranks under ``torchrun`` (Gloo, one thread each) in a network namespace whose loopback ``tc`` limits
(:mod:`bench.netns`). The GPT-2-shaped transformer of :mod:`bench.tasks` (``gpt2_small``: 12 blocks, 11.6M
parameters) is sharded with ``fully_shard`` on every block and on the root, once per row, and the rows' training
steps alternate in one launch (their order flipped every step). Per row: the median step (rank 0, after a barrier),
the throughput against FSDP's float32 reduce-scatter, the loopback bytes a step (both ranks; the all-gathers of
the parameters included, the same in every row) and, for SafeBits, the last loss against FSDP's (same seeds, same
batches: what compression changed).

Rows: ``fsdp`` (FSDP's reduce-scatter in float32), ``fsdp-bf16`` (``MixedPrecisionPolicy(reduce_dtype=bfloat16)``:
FSDP's own compression of the reduce-scatter), ``safebits@B`` (``sbfsdp.compress(model, budget_bits=B)``, ``B`` a
number of bits or ``auto``; with
``+bf16-residual``, ``residual_dtype=torch.bfloat16``). Gloo has
no reduce-scatter of its own: torch runs FSDP's as an all-reduce, twice the bytes NCCL's ring moves. A row ending in
``+a2a`` (``fsdp+a2a``, ``fsdp-bf16+a2a``) reduce-scatters through :class:`AllToAllReduceScatter` instead: one
``all_to_all`` of the rows and a sum in rank order, the ``(P - 1) / P`` of a buffer a ring moves: the fair peer.

DDP rows, for ``--nodes 2`` above all: ``ddp`` (its all-reduce), ``ddp+safebits@B`` (SafeBits' hook over every rank)
and ``ddp-nodes+safebits@B`` (:class:`safebits_hvd.ddp.AcrossNodesState`: SafeBits on the hop across nodes only).

``--quality SEED [SEED ...]``: instead of timing, train ``make demo``'s byte LM (``bench.tasks``, 104,192
parameters, each encoder layer and the root sharded) for its 160 steps per seed and row, and report the final
validation bits per byte, mean and standard deviation over the seeds (the link does not change them), and the bytes
SafeBits' residuals take on rank 0.

Usage (root: it needs ``ip netns`` and ``tc``)::

    python -m bench.experiments.fsdp_link --rate 1gbit --rows fsdp+a2a fsdp fsdp-bf16+a2a safebits@4.4
    python -m bench.experiments.fsdp_link --rate unlimited --rows fsdp+a2a safebits@4.4 --quality 0 1 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

WORKER_FLAG = "--worker"
BF16_RESIDUAL = "+bf16-residual"
DEMO_LM_STEPS = 160          # make demo's (bench/demo.py: --lm-steps 160)


class AllToAllReduceScatter:
    """A reduce-scatter of FSDP's buffer that moves what a ring moves: each rank sends its row ``r`` to rank ``r``
    (``all_to_all_single``) and sums the rows it gets in rank order (``AVG``: divided by the rank count)."""

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        import torch

        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> None:
        import torch
        import torch.distributed as dist

        ranks = dist.get_world_size(group)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        total = received.view(ranks, -1).float().sum(dim=0)
        if op == dist.ReduceOp.AVG:
            total /= ranks
        elif op != dist.ReduceOp.SUM:
            raise ValueError(f"AllToAllReduceScatter takes AVG and SUM, got {op}")
        output_tensor.copy_(total)


def shard(model: Any, blocks: list[Any], row: str, reshard_after_forward: bool = True, mesh: Any = None) -> Any:
    """``fully_shard`` every block and the root as ``row`` asks (its reduce dtype, its reduce-scatter; ``hsdp`` rows:
    across ``mesh``'s two dimensions, FSDP's own or with SafeBits on the hop across replicas); SafeBits' state, or
    None. A SafeBits row ending in ``+bf16-residual`` stores its residuals as bfloat16."""
    import torch
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from safebits_hvd import fsdp as sbfsdp

    name, residual = f"fsdp_link.{row}", torch.bfloat16 if row.endswith(BF16_RESIDUAL) else torch.float32
    row = row.removesuffix(BF16_RESIDUAL)
    base = row.removesuffix("+a2a")
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if base == "fsdp-bf16" else None)
    on = None if not row.startswith("hsdp") else mesh if row == "hsdp" else mesh["shard"]
    for block in blocks:
        fully_shard(block, mesh=on, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=on, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if row.startswith(("safebits@", "hsdp-safebits@")):
        replicate = mesh["replicate"].get_group() if row.startswith("hsdp") else None
        bits = row.split("@", 1)[1]
        return sbfsdp.compress(model, budget_bits=bits if bits == "auto" else float(bits), name=name,
                               replicate_group=replicate, residual_dtype=residual)
    if base not in ("fsdp", "fsdp-bf16", "hsdp") or residual != torch.float32:
        raise SystemExit(f"unknown row {row!r}: fsdp, fsdp-bf16 (+a2a), safebits@B (+bf16-residual), hsdp or "
                         f"hsdp-safebits@B (+bf16-residual)")
    if row.endswith("+a2a"):
        for module in model.modules():
            if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_groups:
                module.set_custom_reduce_scatter(AllToAllReduceScatter())
    return None


def replicate(model: Any, row: str, nodes: int) -> Any:
    """``row``'s DDP model: ``ddp`` (its all-reduce), ``ddp+safebits@B`` (SafeBits' hook over every rank) or
    ``ddp-nodes+safebits@B`` (SafeBits on the hop across nodes only, :class:`~safebits_hvd.ddp.AcrossNodesState`)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from safebits_hvd import ddp as sbddp

    ddp = DistributedDataParallel(model)
    if row == "ddp":
        return ddp
    base, _, bits = row.partition("+safebits@")
    if not bits or base not in ("ddp", "ddp-nodes"):
        raise SystemExit(f"unknown row {row!r}: ddp, ddp+safebits@B or ddp-nodes+safebits@B")
    if base == "ddp":
        state: Any = sbddp.SafeBitsState(ddp.named_parameters(), budget_bits=float(bits), name=f"fsdp_link.{row}")
    else:
        state = sbddp.AcrossNodesState(ddp.named_parameters(), node_size=dist.get_world_size() // nodes,
                                       budget_bits=float(bits), name=f"fsdp_link.{row}")
    ddp.register_comm_hook(state, sbddp.safebits_hook)
    return ddp


def quality(args: argparse.Namespace, rank: int) -> None:
    """``--quality``: ``make demo``'s byte LM per seed and row; rank 0 prints the final validation bits per byte."""
    import math

    import torch

    from bench.tasks import make_task

    task = make_task("bytes_lm", DEMO_LM_STEPS)
    finals: dict[str, list[float]] = {row: [] for row in args.rows}
    residual_bytes: dict[str, int] = {}
    for seed in args.quality:
        for row in args.rows:
            torch.manual_seed(seed)
            model = task.model()
            state = shard(model, list(model.blocks.layers), row)
            opt = task.optimizer(model)
            gen = torch.Generator().manual_seed(seed * 7919 + rank)
            for step in range(task.steps):
                task.set_lr(opt, step)
                opt.zero_grad()
                task.batch_loss(model, gen).backward()
                opt.step()
            finals[row].append(task.evaluate(model)[1])
            if state is not None:
                residual_bytes[row] = state.memory.nbytes
    if rank == 0:
        lines = [f"make demo's byte LM under FSDP2, 2 ranks, {task.steps} steps, seeds {args.quality}: final "
                 f"validation bits per byte; error feedback's residuals, rank 0's", "",
                 "| row | per seed | mean | sd | residuals, KB |", "| --- | --- | --- | --- | --- |"]
        for row, values in finals.items():
            mean = sum(values) / len(values)
            sd = math.sqrt(sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1))
            kb = f"{residual_bytes[row] / 1e3:.1f}" if row in residual_bytes else "-"
            lines.append(f"| {row} | {', '.join(f'{v:.4f}' for v in values)} | {mean:.4f} | {sd:.4f} | {kb} |")
        print("\n".join(lines), flush=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from bench.protocol import SEED, read_tx_bytes
    from bench.tasks import Workload

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    work = Workload(args.model, args.batch)
    mesh = None
    if args.nodes == 2:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    device = os.environ.get("GLOO_SOCKET_IFNAME")

    def sent_bytes() -> int:
        """Bytes sent: over the loopback (one node), or across nodes by this rank's node (two)."""
        if args.nodes == 2 and device:
            with open(f"/sys/class/net/{device}/statistics/tx_bytes", encoding="ascii") as f:
                return int(f.read())
        return read_tx_bytes()

    if args.quality:
        quality(args, rank)
        dist.destroy_process_group()
        return
    cases = []
    for row in args.rows:
        torch.manual_seed(SEED)
        model = work.model()
        if row.startswith("ddp"):
            model = replicate(model, row, args.nodes)
        else:
            shard(model, list(model.blocks), row, args.reshard_after_forward, mesh)
        cases.append((row, model, work.optimizer(model), torch.Generator().manual_seed(SEED * 7919 + rank)))
    times: dict[str, list[float]] = {row: [] for row in args.rows}
    moved: dict[str, list[int]] = {row: [] for row in args.rows}
    losses: dict[str, float] = {}
    for i in range(args.warmup + args.steps):
        for row, model, opt, gen in cases if i % 2 == 0 else reversed(cases):
            dist.barrier()
            sent, start = sent_bytes(), time.perf_counter()
            opt.zero_grad()
            loss = work.loss(model, gen)
            loss.backward()
            opt.step()
            seconds = time.perf_counter() - start
            dist.barrier()
            if i >= args.warmup:
                times[row].append(seconds)
                moved[row].append(sent_bytes() - sent)
            losses[row] = float(loss.detach())
    if rank == 0:
        base = statistics.median(times[args.rows[0]])
        where = "2 nodes of 2 ranks" if args.nodes == 2 else "2 ranks"
        moved_what = "MB a step across nodes, node 0's" if args.nodes == 2 else "link MB a step"
        lines = [f"{args.model}, batch {args.batch} per rank, link {args.rate}, {where}, reshard_after_forward="
                 f"{args.reshard_after_forward}, {args.steps} timed steps (medians, rank 0)", "",
                 f"| row | step, ms | throughput over {args.rows[0]} | {moved_what} | last loss |",
                 "| --- | --- | --- | --- | --- |"]
        for row in args.rows:
            step = statistics.median(times[row])
            lines.append(f"| {row} | {1e3 * step:.1f} | {base / step:.2f}x | "
                         f"{statistics.median(moved[row]) / 1e6:.2f} | {losses[row]:.4f} |")
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="link rate (bench.netns.parse_rate's syntax) or 'unlimited'")
    parser.add_argument("--model", default="gpt2_small", choices=["gpt2_small"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rows", nargs="*", default=["fsdp+a2a", "fsdp", "fsdp-bf16+a2a", "safebits@4.4"])
    parser.add_argument("--no-reshard", dest="reshard_after_forward", action="store_false",
                        help="fully_shard(..., reshard_after_forward=False): parameters stay gathered from forward to "
                             "backward (one all-gather a step, not two; ZeRO-2's traffic)")
    parser.add_argument("--nodes", type=int, choices=[1, 2], default=1,
                        help="2: two nodes of 2 ranks (bench.netns.two_nodes: the link between them limited, inside "
                             "each free); rows hsdp (FSDP's own) and hsdp-safebits@B (SafeBits across nodes only)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quality", nargs="*", type=int, default=[], metavar="SEED",
                        help="train make demo's byte LM per seed instead of timing (see the module docstring)")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def launch(link: Any, argv: list[str], args: argparse.Namespace) -> None:
    from bench.netns import torchrun_two_nodes
    from safebits_hvd.frontends.launch import torchrun

    if args.nodes == 2:
        out = torchrun_two_nodes(link, 2, "bench.experiments.fsdp_link", [*argv, WORKER_FLAG], args.timeout)
    else:
        out = torchrun(2, "-m", "bench.experiments.fsdp_link", *argv, WORKER_FLAG, prefix=link,
                       env={"OMP_NUM_THREADS": "1"}, timeout=args.timeout)
    shown = ("|", "gpt2", "make demo")
    print("\n".join(line for line in out.splitlines() if line.startswith(shown) or not line), flush=True)


def main(argv: list[str] | None = None) -> int:
    from bench.netns import run_on_link

    return run_on_link("sbfsdp", argv, parse_args, worker, launch)


if __name__ == "__main__":
    sys.exit(main())
