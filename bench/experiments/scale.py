"""Bytes and communication time per step from 2 to 1,024 ranks: SafeBits' collectives against float32 and bf16 ring
all-reduce and PowerSGD, modelled from measured inputs, the model checked against bytes measured here
(docs/RESULTS.md, section 8.2).

The model (``--model``, pure computation). A cluster of ``P`` ranks in nodes of ``G`` GPUs (``--gpus-per-node``, 8):
inside a node the GPUs talk over NVLink (``--nvlink-gbyte``), between nodes through the node's NIC (25, 100 and
400 Gbit/s; one NIC per node, its rate shared by the node's GPUs). Per path, the bytes a step puts through one node's
NIC and over one GPU's NVLink, and the elements each rank encodes and decodes:

* ``fp32 ring``, ``bf16 ring``: a ring all-reduce, ``2 (P - 1) / P`` times the gradient on every ring edge; the slowest
  edge (a NIC once the ring spans nodes) sets the time;
* ``PowerSGD r4``: ring all-reduces of the rank-4 factors of every matrix (``P`` and ``Q``) and of every vector in
  float32 (the compute is left out, in PowerSGD's favour);
* ``allgather`` (built): every rank's payload on every ring edge, ``P - 1`` payloads; every rank decodes ``P - 1``;
* ``two-phase`` (built): an all-to-all of payload segments (a node's GPUs send ``G (P - G) / P`` payloads through
  its NIC) and a ring allgather of the re-encoded segments, ``(P - 1) / P`` payloads per edge;
* ``hierarchical`` (issue 58's design): an fp32 reduce-scatter inside the node, SafeBits across nodes on each GPU's
  ``1 / G`` shard (allgather for two nodes, two-phase for more; the node's ``G`` streams share its NIC), an fp32
  allgather inside the node;
* ``sharded`` (issue 58's design, FSDP2's reduce-scatter): each rank's payload slices go to their owners in one
  all-to-all over every rank (a node's GPUs send ``G (P - G) / P`` payloads through its NIC); ``sharded, by node``:
  an fp32 reduce-scatter inside the node first, then the all-to-all of ``1 / G`` shards across nodes (ZeRO++'s
  qgZ order). Against FSDP's own reduce-scatter in bf16, ``(P - 1) / P`` of the gradient per edge.

Time per step = link time + encode and decode time, with nothing overlapped (what the step exposes when backward
is done): an upper bound for every row alike. The inputs are measured (``--inputs``): the payload's bits per
parameter at the budget (SafeBits' own modeled bits with headers, on the model's shapes), and the nanoseconds per
element of the packing pass and of a decode-and-add, on this machine's CPU (``--measure-inputs``) or as given
(``--encode-ns``, ``--decode-ns``: a GPU's, from ``bench/gpu_check.sh``). ``auto`` is ``collectives.choose``'s path
at the budget, or the float32 pass-through where that is faster.

The check (``--measure --ranks 2 4 8``): one ``torchrun`` launch per rank count in a network namespace (its own
loopback, no limit). An MLP trains a few steps under DDP's default hook, SafeBits' hook on the allgather path and on
the two-phase path, and sharded by FSDP2 with SafeBits' reduce-scatter (``sharded``; one parameter all-gather a
step); rank 0 reads the loopback's sent bytes around the timed steps. Each is compared with the model's bytes for
that path: SafeBits' ``StepRecord.wire_bytes`` summed over ranks (each rank's payloads times the traffic factors
above; ``sharded``: plus FSDP's all-gathers, ``(P - 1) / P`` of the padded float32 parameters a rank) and DDP's
``2 (P - 1) / P`` times the gradient per rank.

Usage::

    .venv/bin/python -m bench.experiments.scale --measure --ranks 2 4 8        # root: ip netns
    .venv/bin/python -m bench.experiments.scale --model --out results/scale
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WORKER_FLAG = "--worker"
RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
NIC_GBIT = (25, 100, 400)
GPUS_PER_NODE = 8
NVLINK_GBYTE = 300.0          # an H100/H200 NVLink's all-reduce bus bandwidth, GB/s (nccl-tests' order of it)
BUDGET_BITS = 4.4
POWERSGD_RANK = 4
PATHS = ("fp32 ring", "bf16 ring", "PowerSGD r4", "allgather", "two-phase", "hierarchical", "sharded",
         "sharded, by node", "bf16 reduce-scatter")
SAFEBITS_PATHS = ("allgather", "two-phase", "hierarchical", "sharded", "sharded, by node")
MEASURE_CASES = ("ddp", "allgather", "two_phase", "sharded")
MLP_WIDTH, MLP_LAYERS = 512, 4


@dataclass(frozen=True)
class Inputs:
    """What the model takes from measurements: the model's gradient and SafeBits' costs on it."""

    model: str
    parameters: int
    payload_bits: float            # payload bits per parameter at the budget, scales and headers included
    powersgd_bits: float           # PowerSGD's factors and vectors, bits per parameter on the ring
    encode_ns: float               # the packing pass (with error feedback), ns per element
    decode_ns: float               # one payload decoded and added, ns per element
    source: str                    # where encode_ns and decode_ns were measured


@dataclass(frozen=True)
class Traffic:
    """One path's step on one cluster: bytes through a node's NIC, over a GPU's NVLink, and the elements one rank
    encodes and decodes."""

    nic_bytes: float
    nvlink_bytes: float
    encoded: float
    decoded: float


def nodes_of(ranks: int, gpus_per_node: int) -> int:
    """Nodes of a cluster of ``ranks``: whole nodes beyond one."""
    if ranks < 1 or gpus_per_node < 1:
        raise ValueError(f"ranks and GPUs per node must be >= 1, got {ranks} and {gpus_per_node}")
    if ranks > gpus_per_node and ranks % gpus_per_node:
        raise ValueError(f"{ranks} ranks do not fill nodes of {gpus_per_node}")
    return max(1, ranks // gpus_per_node)


def ring(ranks: int, nodes: int, edge_bytes: float) -> Traffic:
    """A ring collective whose every edge carries ``edge_bytes``: through the NIC once the ring spans nodes."""
    return Traffic(edge_bytes if nodes > 1 else 0.0, edge_bytes if ranks > 1 else 0.0, 0.0, 0.0)


def traffic(path: str, ranks: int, gpus_per_node: int, inputs: Inputs) -> Traffic:
    """The bytes and work of one step of ``path`` (see the module docstring) for ``inputs``' gradient."""
    n, p, g = float(inputs.parameters), ranks, min(gpus_per_node, ranks)
    nodes = nodes_of(ranks, gpus_per_node)
    payload = n * inputs.payload_bits / 8
    if path in ("fp32 ring", "bf16 ring"):
        return ring(p, nodes, 2 * (p - 1) / p * n * (4 if path == "fp32 ring" else 2))
    if path == "PowerSGD r4":
        return ring(p, nodes, 2 * (p - 1) / p * n * inputs.powersgd_bits / 8)
    if path == "bf16 reduce-scatter":
        return ring(p, nodes, (p - 1) / p * n * 2)
    if path == "allgather":
        t = ring(p, nodes, (p - 1) * payload)
        return Traffic(t.nic_bytes, t.nvlink_bytes, n, (p - 1) * n)
    if path == "two-phase":
        second = (p - 1) / p * payload
        nic = (g * (p - g) / p * payload + second) if nodes > 1 else 0.0
        return Traffic(nic, (g - 1) / p * payload + second, n + n / p, 2 * (p - 1) / p * n)
    inside = 2 * (g - 1) / g * n * 4            # fp32 reduce-scatter and allgather inside the node
    if path == "hierarchical":
        shard = n / g
        if nodes == 1:
            return Traffic(0.0, inside, 0.0, 0.0)
        if nodes == 2:
            return Traffic((nodes - 1) * payload, inside, shard, (nodes - 1) * shard)
        return Traffic(2 * (nodes - 1) / nodes * payload, inside, shard + shard / nodes,
                       2 * (nodes - 1) / nodes * shard)
    if path == "sharded":
        nic = g * (p - g) / p * payload if nodes > 1 else 0.0
        return Traffic(nic, (g - 1) / p * payload, n, (p - 1) / p * n)
    if path == "sharded, by node":
        if nodes == 1:
            return Traffic(0.0, (g - 1) / g * n * 4, 0.0, 0.0)
        return Traffic((nodes - 1) / nodes * payload, (g - 1) / g * n * 4, n / g, (nodes - 1) / nodes * n / g)
    raise ValueError(f"unknown path {path!r}; known: {PATHS}")


def link_seconds(t: Traffic, nic_gbit: float, nvlink_gbyte: float) -> float:
    """Link time: the NIC's bytes, then NVLink's (one after the other)."""
    return t.nic_bytes * 8 / (nic_gbit * 1e9) + t.nvlink_bytes / (nvlink_gbyte * 1e9)


def step_seconds(t: Traffic, nic_gbit: float, nvlink_gbyte: float, inputs: Inputs) -> float:
    """Link time plus encode and decode time: nothing overlapped."""
    compute = t.encoded * inputs.encode_ns + t.decoded * inputs.decode_ns
    return link_seconds(t, nic_gbit, nvlink_gbyte) + compute * 1e-9


def auto_path(ranks: int, inputs: Inputs) -> str:
    """The packed path ``budget_bits`` at :data:`BUDGET_BITS` takes (``collectives.choose``)."""
    from safebits_hvd.comm.collectives import choose

    return {"allgather": "allgather", "two_phase": "two-phase"}[choose("auto", inputs.payload_bits, ranks)]


def grid(inputs: Inputs, ranks: Sequence[int] = RANKS, nic_gbit: Sequence[float] = NIC_GBIT,
         gpus_per_node: int = GPUS_PER_NODE, nvlink_gbyte: float = NVLINK_GBYTE) -> list[dict[str, Any]]:
    """One row per (NIC, ranks, path): NIC MB and seconds per step; ``auto``: its path, or the float32 pass-through
    where that is faster."""
    rows = []
    for nic in nic_gbit:
        for p in ranks:
            times = {}
            for path in PATHS:
                t = traffic(path, p, gpus_per_node, inputs)
                times[path] = step_seconds(t, nic, nvlink_gbyte, inputs)
                rows.append({"nic_gbit": nic, "ranks": p, "path": path, "nic_mb": t.nic_bytes / 1e6,
                             "nvlink_mb": t.nvlink_bytes / 1e6, "seconds": times[path],
                             "link_seconds": link_seconds(t, nic, nvlink_gbyte), "work": t.encoded + t.decoded})
            packed = auto_path(p, inputs)
            chosen = packed if times[packed] <= times["fp32 ring"] else "fp32 ring"
            rows.append({"nic_gbit": nic, "ranks": p, "path": "auto", "chose": chosen, "nic_mb": None,
                         "nvlink_mb": None, "seconds": times[chosen], "link_seconds": None, "work": None})
    return rows


def reference_of(path: str) -> str:
    """What a SafeBits path competes with: bf16 reduce-scatter for the sharded ones, else the bf16 ring."""
    return "bf16 reduce-scatter" if path.startswith("sharded") else "bf16 ring"


def crossovers(rows: list[dict[str, Any]]) -> dict[tuple[float, str], int | None]:
    """Per (NIC, SafeBits path): the fewest ranks of the grid from which the path's LINK time (bytes alone, its
    compute left out) exceeds its bf16 reference's at every larger rank count (None: never)."""
    out: dict[tuple[float, str], int | None] = {}
    for nic in sorted({r["nic_gbit"] for r in rows}):
        at = {(r["ranks"], r["path"]): r["link_seconds"] for r in rows if r["nic_gbit"] == nic}
        ranks = sorted({p for p, _ in at})
        for path in SAFEBITS_PATHS:
            first = None
            for p in reversed(ranks):
                if at[(p, path)] <= at[(p, reference_of(path))]:
                    break
                first = p
            out[(nic, path)] = first
    return out


def break_even_ns(row: dict[str, Any], reference: dict[str, Any]) -> float | None:
    """The most encode-and-decode time per element (ns, over every element the path encodes and decodes) at which
    ``row``'s step still ties ``reference``'s; None where its link time alone is already longer."""
    spare = reference["seconds"] - row["link_seconds"]
    if spare <= 0 or not row["work"]:
        return None
    return 1e9 * spare / row["work"]


# ---------------------------------------------------------------------------------------------- the inputs
def powersgd_bits(shapes: Sequence[tuple[int, ...]], rank: int = POWERSGD_RANK) -> float:
    """PowerSGD's float32 bits on the ring per parameter: ``rank (rows + columns)`` for each matrix (views of
    higher-dimensional tensors as PyTorch's hook takes them: the first dimension by the rest), every vector whole."""
    sent = total = 0
    for shape in shapes:
        n = math.prod(shape)
        total += n
        if len(shape) < 2:
            sent += n
        else:
            rows, cols = shape[0], n // shape[0]
            sent += min(n, rank * (rows + cols))
    return 32.0 * sent / total


def measure_inputs(model: str, budget_bits: float = BUDGET_BITS, elements: int = 1 << 22) -> Inputs:
    """The payload's bits per parameter of one SafeBits step on ``model``'s shapes (``bench.suites.model_shapes``;
    its modeled bits and 16-byte headers), and the packing pass and decode-and-add of ``elements`` floats at the
    action most of that step sends, timed on this machine's CPU (best of 5, one thread)."""
    import collections

    import torch

    from bench.suites import bench_step, model_shapes
    from bench.suites.timing import min_seconds
    from safebits_hvd.codec import actions as A
    from safebits_hvd.codec import kernels as K
    from safebits_hvd.codec import rng, wire

    torch.set_num_threads(1)
    shapes = [shape for _, shape in model_shapes.MODELS[model]()]
    sizes = [model_shapes.numel(s) for s in shapes]
    compressor, step, _ = bench_step.make_step(sizes, "allgather", budget_bits)
    for _ in range(2):
        step()
    record = compressor.last_step
    assert record is not None
    n = sum(sizes)
    bits = (record.modeled_bits_total + 8 * wire.HEADER_BYTES * len(sizes)) / n
    weight: collections.Counter[str] = collections.Counter()
    for name, action in record.actions.items():
        weight[action] += sizes[int(name[1:])]
    action = A.ACTIONS[weight.most_common(1)[0][0]]
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(elements, generator=gen)
    e, out = torch.randn(elements, generator=gen) * 0.01, torch.zeros(elements)
    key = rng.stream_key(0, 1, 2)
    payload, _ = K.quantize_pack_ef(g, e, action, key)

    def best(fn: Any) -> float:
        fn()                        # warm: the kernels compiled, the memory touched
        return min_seconds(fn, 5)

    encode = best(lambda: K.quantize_pack_ef(g, e, action, key, payload))
    decode = best(lambda: K.decode_add(payload, out))
    return Inputs(model, n, bits, powersgd_bits(shapes), 1e9 * encode / elements, 1e9 * decode / elements,
                  f"this machine's CPU, one thread, {action.name} on {elements:,} floats")


# ---------------------------------------------------------------------------------------------- the check
def mlp_parameters(width: int = MLP_WIDTH, layers: int = MLP_LAYERS) -> int:
    return layers * (width * width + width)


def modelled_ddp_bytes(ranks: int, parameters: int, steps: int) -> float:
    """Loopback bytes of ``steps`` DDP steps of float32 ring all-reduces over ``ranks`` ranks: every rank sends
    ``2 (P - 1) / P`` times the gradient."""
    return steps * ranks * 2 * (ranks - 1) / ranks * parameters * 4


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from bench.protocol import read_tx_bytes
    from bench.suites.step_timing import make_model
    from safebits_hvd import ddp as sbddp
    from safebits_hvd import fsdp as sbfsdp

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    results = []
    for case in MEASURE_CASES:
        torch.manual_seed(0)
        state: Any = None
        gathered = 0.0          # FSDP's parameter all-gathers: (P - 1) / P of the padded float32 parameters a rank
        if case == "sharded":
            model = make_model(MLP_WIDTH, MLP_LAYERS)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, reshard_after_forward=False)       # one all-gather a step
            fully_shard(model, reshard_after_forward=False)
            state = sbfsdp.compress(model, budget_bits=BUDGET_BITS, name="scale.sharded")
            padded = sum(ranks * m.row for m in state.modules)
            gathered = args.steps * ranks * (ranks - 1) / ranks * padded * 4
        else:
            model = nn.parallel.DistributedDataParallel(make_model(MLP_WIDTH, MLP_LAYERS))
        if case not in ("ddp", "sharded"):
            state = sbddp.SafeBitsState(model.named_parameters(), budget_bits=BUDGET_BITS, collective=case,
                                        name=f"scale.{case}")
            model.register_comm_hook(state, sbddp.safebits_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(rank)

        def step(model: Any = model, opt: Any = opt, gen: Any = gen) -> None:
            opt.zero_grad()
            x = torch.randn(16, MLP_WIDTH, generator=gen)
            model(x).pow(2).mean().backward()
            opt.step()

        for _ in range(args.warmup):
            step()
        dist.barrier()
        sent = read_tx_bytes()
        for _ in range(args.steps):
            step()
        dist.barrier()
        sent = read_tx_bytes() - sent
        parameters = sum(p.numel() for p in model.parameters())
        if state is None:
            modelled = modelled_ddp_bytes(ranks, parameters, args.steps)
        else:
            wire = torch.tensor([float(sum(r.wire_bytes for r in state.history[-args.steps:]))], dtype=torch.float64)
            dist.all_reduce(wire)
            modelled = float(wire) + gathered
            path = "reduce_scatter" if case == "sharded" else case
            assert all(r.collective == path for r in state.history[-args.steps:])
        results.append({"ranks": ranks, "case": case, "parameters": parameters, "steps": args.steps,
                        "measured_bytes": sent, "modelled_bytes": modelled})
        dist.barrier()
    if rank == 0:
        Path(args.json).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def run_measure(ranks: int, args: argparse.Namespace, json_path: Path) -> list[dict[str, Any]]:
    """One torchrun launch of :func:`worker` on ``ranks`` ranks in a namespace of its own (unlimited loopback)."""
    from bench.netns import limited_namespace
    from safebits_hvd.frontends.launch import torchrun

    with limited_namespace(f"sbscale{ranks}", "unlimited") as prefix:
        if prefix is None:
            raise SystemExit("[scale] cannot create a network namespace: run as root with ip and tc (iproute2)")
        torchrun(ranks, "-m", "bench.experiments.scale", WORKER_FLAG, "--json", str(json_path),
                 "--steps", str(args.steps), "--warmup", str(args.warmup), prefix=prefix,
                 env={"OMP_NUM_THREADS": "1"}, timeout=args.timeout)
    return json.loads(json_path.read_text())


def check_markdown(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| ranks | path | measured MB / step | model MB / step | measured / model |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        measured, modelled = r["measured_bytes"] / r["steps"] / 1e6, r["modelled_bytes"] / r["steps"] / 1e6
        lines.append(f"| {r['ranks']} | {r['case']} | {measured:.3f} | {modelled:.3f} | {measured / modelled:.4f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the report
def model_markdown(inputs: Inputs, rows: list[dict[str, Any]], ranks_shown: Sequence[int] = (2, 8, 16, 64, 256,
                                                                                              1024)) -> str:
    at = {(r["nic_gbit"], r["ranks"], r["path"]): r for r in rows}
    out = [f"{inputs.model}: {inputs.parameters:,} parameters; SafeBits at {BUDGET_BITS} bits sends "
           f"{inputs.payload_bits:.2f} bits per parameter, PowerSGD r{POWERSGD_RANK} {inputs.powersgd_bits:.2f}; "
           f"encode {inputs.encode_ns:.2f} ns and decode {inputs.decode_ns:.2f} ns per element ({inputs.source}); "
           f"nodes of {GPUS_PER_NODE}, NVLink {NVLINK_GBYTE:g} GB/s.", ""]
    for nic in sorted({r["nic_gbit"] for r in rows}):
        out += [f"NIC {nic:g} Gbit/s: ms per step (NIC MB per node per step)", "",
                "| path | " + " | ".join(f"{p} ranks" for p in ranks_shown) + " |",
                "| --- |" + " --- |" * len(ranks_shown)]
        for path in (*PATHS, "auto"):
            cells = []
            for p in ranks_shown:
                r = at[(nic, p, path)]
                cell = f"{1e3 * r['seconds']:.3g}"
                cell += f" ({r['chose']})" if path == "auto" else f" ({r['nic_mb']:.4g})"
                cells.append(cell)
            out.append(f"| {path} | " + " | ".join(cells) + " |")
        out.append("")
    crossing = crossovers(rows)
    nics = sorted({r["nic_gbit"] for r in rows})
    out += ["Where each SafeBits path's link time stops beating its bf16 reference (bf16 ring; bf16 reduce-scatter "
            "for the sharded rows), fewest ranks, compute left out:", "",
            "| path | " + " | ".join(f"{nic:g} Gbit/s" for nic in nics) + " |", "| --- |" + " --- |" * len(nics)]
    for path in SAFEBITS_PATHS:
        out.append(f"| {path} | " + " | ".join(str(crossing[(nic, path)] or "never") for nic in nics) + " |")
    out += ["", "The most encode-and-decode time per element (ns) at which each path still ties its bf16 reference "
            "(-: its link time alone is longer):", "",
            "| path | " + " | ".join(f"{nic:g} Gbit/s, {p} ranks" for nic in nics for p in (16, 64, 1024)) + " |",
            "| --- |" + " --- |" * (3 * len(nics))]
    for path in SAFEBITS_PATHS:
        cells = []
        for nic in nics:
            for p in (16, 64, 1024):
                ns = break_even_ns(at[(nic, p, path)], at[(nic, p, reference_of(path))])
                cells.append("-" if ns is None else f"{ns:.3g}")
        out.append(f"| {path} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nics = sorted({r["nic_gbit"] for r in rows})
    fig, axes = plt.subplots(1, len(nics), figsize=(5 * len(nics), 4.2), sharey=True)
    for ax, nic in zip(axes, nics, strict=True):
        for name in PATHS:
            pts = sorted((r["ranks"], r["seconds"]) for r in rows if r["nic_gbit"] == nic and r["path"] == name)
            ax.plot([p for p, _ in pts], [1e3 * s for _, s in pts], marker=".", label=name,
                    linestyle="-" if name in SAFEBITS_PATHS else "--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"NIC {nic:g} Gbit/s")
        ax.set_xlabel("ranks")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("communication per step, ms (nothing overlapped)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="store_true", help="the modelled tables and plot")
    parser.add_argument("--models", nargs="*", default=["gpt2_small", "resnet50"])
    parser.add_argument("--inputs", default=None, help="a JSON of Inputs per model (else measured here)")
    parser.add_argument("--encode-ns", type=float, default=None)
    parser.add_argument("--decode-ns", type=float, default=None)
    parser.add_argument("--measure", action="store_true", help="bytes on the loopback against the model")
    parser.add_argument("--ranks", nargs="*", type=int, default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=None, help="a folder for scale.md, scale.png and the JSON")
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(args)
        return 0
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    report: list[str] = []
    worst = 0.0
    if args.measure:
        results = []
        for ranks in args.ranks:
            json_path = (out or Path("/tmp")) / f"scale_measured_np{ranks}.json"
            results += run_measure(ranks, args, json_path)
        worst = max(abs(r["measured_bytes"] / r["modelled_bytes"] - 1) for r in results)
        report += [f"Measured against modelled loopback bytes (MLP of {mlp_parameters():,} parameters, "
                   f"{args.steps} steps after {args.warmup}; worst {100 * worst:.2f}%):", "",
                   check_markdown(results), ""]
    if args.model:
        given = json.loads(Path(args.inputs).read_text()) if args.inputs else {}
        all_inputs = []
        for model in args.models:
            inputs = Inputs(**given[model]) if model in given else measure_inputs(model)
            if args.encode_ns is not None or args.decode_ns is not None:
                inputs = Inputs(**{**asdict(inputs), "encode_ns": args.encode_ns or inputs.encode_ns,
                                   "decode_ns": args.decode_ns or inputs.decode_ns, "source": "given"})
            all_inputs.append(inputs)
            rows = grid(inputs)
            report.append(model_markdown(inputs, rows))
            if out:
                plot(rows, out / f"scale_{model}.png", f"{model}: SafeBits at {BUDGET_BITS} bits against rings")
        if out:
            (out / "inputs.json").write_text(json.dumps({i.model: asdict(i) for i in all_inputs}, indent=1))
    text = "\n".join(report)
    print(text, flush=True)
    if out:
        (out / "scale.md").write_text(text)
    return 1 if worst > 0.05 else 0


if __name__ == "__main__":
    sys.exit(main())
