"""Bytes per rank by collective: what each way of moving SafeBits' packed payloads costs, modeled and measured
(docs/RESULTS.md, section 8.2).

Two parts (docs/DESIGN.md, "Compressed collectives"):

* ``--table`` (pure computation): bits per gradient element that EACH rank sends, for ``P`` ranks and ``b``-bit
  payloads (``b`` = modeled bits per parameter, per-bucket scales included):

  - allgather (implemented): every rank's payload reaches every other rank, ``b (P - 1)``;
  - two-phase scatter-reduce + allgather (planned at commit a8a3072; the formula either way):
    ``2 b (P - 1) / P``;
  - fp32 and fp16 ring allreduce (``dense`` is the fp32 one): ``2 * 32 (P - 1) / P`` and ``2 * 16 (P - 1) / P``;

  each also as a multiple of the fp32 ring allreduce, what ``safebits_hvd.comm.collectives.choose("auto", b, P)``
  picks (imported, not re-implemented), and what the 16-byte per-tensor payload header
  (``safebits_hvd.codec.wire.HEADER_BYTES``) adds for a tensor of ``--tensor-elements`` elements.

* ``--measure --ranks N [N ...]``: one ``horovodrun -np N --gloo`` launch per N (``safebits_hvd.frontends.launch``) of
  this same file with ``--worker``. Each rank trains a small MLP (279,360 parameters in 6 tensors) for a few steps with
  ``hvd.DistributedOptimizer(..., compression=sb.SafeBits(model.named_parameters(), budget_bits=B))`` for each
  budget ``B`` and reads ``compression.last_step``: ``collective``, ``wire_bytes`` (this rank's bytes for the
  step) and ``modeled_bits_total``. Rank 0 writes the JSON (``--json``, default
  ``results/collective_bytes_np{N}.json``); the launcher then checks that every step's collective equals
  ``choose("auto", modeled_bits_total / parameters, N)`` and tabulates wire bytes against modeled bits / 8.

Run it::

    .venv/bin/python -m bench.experiments.collective_bytes --table                   # print the modeled tables
    .venv/bin/python -m bench.experiments.collective_bytes --measure --ranks 2 4                  # two short launches
    .venv/bin/python -m bench.experiments.collective_bytes --table --measure --ranks 2 4 \
        --out results/collective_bytes.md

Exit status 1 if a measured step's collective disagrees with ``choose``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

from safebits_hvd.codec.wire import HEADER_BYTES  # noqa: E402
from safebits_hvd.comm.collectives import COLLECTIVES, choose  # noqa: E402

TWO_PHASE_STATUS = "implemented" if "two_phase" in COLLECTIVES else "planned, not implemented"
RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PAYLOAD_BITS = (1.0, 1.6, 2.0, 4.0, 4.4, 8.0)
BUDGETS = (2.0, 4.4, 8.0, 16.0, 24.0)
TENSOR_ELEMENTS = 1_000_000
FP32_BITS = 32
FP16_BITS = 16


# ---------------------------------------------------------------------------------------------- pure model
def allgather_bits(b: float, ranks: int) -> float:
    """Bits per element each rank sends when its ``b``-bit payload reaches every other rank: ``b (P - 1)``."""
    _check(b, ranks)
    return b * (ranks - 1)


def two_phase_bits(b: float, ranks: int) -> float:
    """Bits per element each rank sends in a scatter-reduce then allgather of ``b``-bit chunks:
    ``2 b (P - 1) / P``."""
    _check(b, ranks)
    return 2.0 * b * (ranks - 1) / ranks


def ring_allreduce_bits(width: int, ranks: int) -> float:
    """Bits per element each rank sends in a ring allreduce of ``width``-bit values: ``2 width (P - 1) / P``."""
    _check(width, ranks)
    return 2.0 * width * (ranks - 1) / ranks


def relative_to_fp32(bits: float, ranks: int) -> float:
    """``bits`` as a multiple of the fp32 ring allreduce at ``ranks`` ranks."""
    return bits / ring_allreduce_bits(FP32_BITS, ranks)


def auto_choice(b: float, ranks: int) -> str:
    """What ``collective="auto"`` picks for a step whose allocation models ``b`` bits per parameter (SafeBits'
    own :func:`safebits_hvd.comm.collectives.choose`, not a copy of it)."""
    return choose("auto", b, ranks)


def header_bits_per_element(collective: str, ranks: int, elements: int) -> float:
    """Bits per element each rank sends for payload headers, for one tensor of ``elements`` elements.

    ``allgather``: one ``HEADER_BYTES`` header per payload, sent to ``P - 1`` ranks. ``two-phase`` (an assumption
    about the planned design): each of the ``P - 1`` chunks a rank sends in each phase is its own payload with its
    own header, ``2 (P - 1)`` headers. ``dense`` / ring: no header (raw float values).
    """
    if elements < 1:
        raise ValueError(f"elements must be >= 1, got {elements}")
    _check(1, ranks)
    headers = {"allgather": ranks - 1, "two-phase": 2 * (ranks - 1), "dense": 0}
    if collective not in headers:
        raise ValueError(f"collective must be one of {sorted(headers)}, got {collective!r}")
    return HEADER_BYTES * 8 * headers[collective] / elements


def _check(bits: float, ranks: int) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    if not bits > 0:
        raise ValueError(f"bits must be > 0, got {bits!r}")


def table_rows(ranks: Sequence[int] = RANKS, payload_bits: Sequence[float] = PAYLOAD_BITS
               ) -> list[tuple[str, list[float]]]:
    """(row label, bits per element per rank for each P): allgather and two-phase per ``b``, then the rings."""
    rows: list[tuple[str, list[float]]] = []
    for b in payload_bits:
        rows.append((f"allgather, b={_num(b)}", [allgather_bits(b, p) for p in ranks]))
    for b in payload_bits:
        rows.append((f"two-phase, b={_num(b)}", [two_phase_bits(b, p) for p in ranks]))
    rows.append(("fp32 ring allreduce (dense)", [ring_allreduce_bits(FP32_BITS, p) for p in ranks]))
    rows.append(("fp16 ring allreduce", [ring_allreduce_bits(FP16_BITS, p) for p in ranks]))
    return rows


def auto_rows(ranks: Sequence[int] = RANKS, payload_bits: Sequence[float] = PAYLOAD_BITS
              ) -> list[tuple[float, list[str]]]:
    """(b, ``choose("auto", b, P)`` for each P)."""
    return [(b, [auto_choice(b, p) for p in ranks]) for b in payload_bits]


def _num(value: float) -> str:
    """A number in at most 4 significant digits, no trailing zeros (1, 1.6, 63.94, 4501)."""
    text = f"{value:.4g}"
    if "e" in text:
        text = f"{value:.0f}"
    return text


def _ratio(value: float) -> str:
    return f"{value:.3g}x"


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def table_markdown(ranks: Sequence[int] = RANKS, payload_bits: Sequence[float] = PAYLOAD_BITS,
                   elements: int = TENSOR_ELEMENTS) -> str:
    """The modeled tables as markdown: bits per element per rank (and x of fp32 ring), auto's pick, headers."""
    header = ["collective", *(f"P={p}" for p in ranks)]
    bits_rows = [[label, *(f"{_num(v)} ({_ratio(relative_to_fp32(v, p))})" for v, p in zip(values, ranks,
                                                                                           strict=True))]
                 for label, values in table_rows(ranks, payload_bits)]
    lines = ["Bits per gradient element sent by each rank, and in brackets as a multiple of the fp32 ring "
             f"allreduce (`b` = modeled bits per parameter of the payload; two-phase: {TWO_PHASE_STATUS}):",
             "", *_markdown(header, bits_rows), ""]
    lines += ["`collective=\"auto\"`: what `safebits_hvd.comm.collectives.choose(\"auto\", b, P)` returns "
              "(dense = fp32 ring allreduce):", ""]
    choice_rows = [[f"b={_num(b)}", *picks] for b, picks in auto_rows(ranks, payload_bits)]
    lines += [*_markdown(["auto picks", *(f"P={p}" for p in ranks)], choice_rows), ""]
    b_min = min(payload_bits)
    head_rows = []
    for p in ranks:
        ag = header_bits_per_element("allgather", p, elements)
        tp = header_bits_per_element("two-phase", p, elements)
        head_rows.append([str(p), f"{ag:.4g}", f"{100 * ag / allgather_bits(b_min, p):.3g}%",
                          f"{tp:.4g}", f"{100 * tp / two_phase_bits(b_min, p):.3g}%"])
    lines += [f"Note, payload headers: each packed payload carries a {HEADER_BYTES}-byte header "
              f"(`safebits_hvd.codec.wire.HEADER_BYTES`), per tensor and not counted above. For one tensor of "
              f"{elements:,} elements, the header bits per element each rank sends (allgather: `P - 1` headers; "
              f"two-phase, assuming one header per chunk: `2 (P - 1)` headers, so `P` times the allgather "
              f"overhead relative to the body) and their share of the b={_num(b_min)} body; a tensor of `n` "
              f"elements scales them by {elements:,} / n:", ""]
    lines += _markdown(["P", "allgather header bits/elem", f"vs b={_num(b_min)} body", "two-phase header bits/elem",
                        f"vs b={_num(b_min)} body"], head_rows)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- measured
def check_steps(steps: Sequence[dict[str, Any]], ranks: int, parameters: int) -> list[str]:
    """Problems with measured step records: a collective other than ``choose("auto", modeled bits per
    parameter, ranks)``. Each step is ``{"budget", "step", "collective", "modeled_bits_total", ...}``."""
    problems = []
    for s in steps:
        expected = choose("auto", s["modeled_bits_total"] / parameters, ranks)
        if s["collective"] != expected:
            problems.append(f"np {ranks}, budget {s['budget']}, step {s['step']}: collective {s['collective']!r}, "
                            f"choose('auto', {s['modeled_bits_total'] / parameters:.4f}, {ranks}) = {expected!r}")
    return problems


def measured_markdown(results: Sequence[dict[str, Any]]) -> str:
    """One row per (np, budget), from the last measured step (all ranks; wire bytes per rank)."""
    header = ["np", "budget bits", "modeled bits/param", "choose(auto)", "collective", "steps per collective",
              "wire bytes per rank", "modeled bits/8 per rank", "wire - modeled/8", "headers (16 B x tensors)",
              "sent per rank (model)"]
    rows = []
    for result in results:
        ranks, parameters, tensors = result["ranks"], result["parameters"], result["tensors"]
        for budget in result["budgets"]:
            steps = [s for s in result["steps"] if s["budget"] == budget]
            last = steps[-1]
            b = last["modeled_bits_total"] / parameters
            modeled_bytes = last["modeled_bits_total"] / 8
            wire = last["wire_bytes"]
            wires = sorted(set(wire))
            shown = f"{wires[0]:,}" if len(wires) == 1 else "/".join(f"{w:,}" for w in wire)
            diff = sorted({w - modeled_bytes for w in wire})
            factor = {"allgather": ranks - 1, "dense": 2 * (ranks - 1) / ranks}.get(last["collective"])
            sent = "/".join(f"{w * factor:,.0f}" for w in sorted(set(wire))) if factor is not None else "n/a"
            counts = Counter(s["collective"] for s in steps)
            rows.append([str(ranks), _num(budget), f"{b:.3f}", choose("auto", b, ranks), last["collective"],
                         ", ".join(f"{c} {n}" for c, n in sorted(counts.items())), shown, f"{modeled_bytes:,.0f}",
                         "/".join(f"{d:,.0f}" for d in diff),
                         f"{HEADER_BYTES * tensors:,}" if last["collective"] == "allgather" else "-",
                         sent])
    return "\n".join(_markdown(header, rows)) + "\n"


def run_measure(ranks: int, budgets: Sequence[float], steps: int, json_path: Path, timeout: float) -> dict[str, Any]:
    """One ``horovodrun -np ranks --gloo`` launch of this file's worker; returns rank 0's JSON."""
    from safebits_hvd.frontends.launch import horovodrun

    json_path.parent.mkdir(parents=True, exist_ok=True)
    if json_path.exists():
        json_path.unlink()
    start = time.perf_counter()
    horovodrun(ranks, __file__, "--worker", "--steps", str(steps), "--json", str(json_path),
               "--budgets", *(str(b) for b in budgets), transport="gloo", timeout=timeout)
    wall = time.perf_counter() - start
    result = json.loads(json_path.read_text())
    result["launch_wall_s"] = round(wall, 1)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def worker(budgets: Sequence[float], steps: int, json_path: str) -> None:
    """One Horovod rank: train the MLP ``steps`` steps per budget, gather every rank's step records."""
    import horovod.torch as hvd
    import torch

    import safebits_hvd as sb

    hvd.init()
    torch.manual_seed(0)
    teacher = torch.randn(256, 64)
    records: list[dict[str, Any]] = []
    parameters = tensors = 0
    for k, budget in enumerate(budgets):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 64))
        parameters = sum(p.numel() for p in model.parameters())
        tensors = len(list(model.parameters()))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = sb.SafeBits(model.named_parameters(), budget_bits=budget, name=f"safebits{k}")
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression=compression)
        generator = torch.Generator().manual_seed(100 + hvd.rank())
        for _ in range(steps):
            x = torch.randn(64, 256, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), x @ teacher)
            opt.zero_grad()
            loss.backward()
            opt.step()
            record = compression.last_step
            assert record is not None
            records.append({"budget": budget, "step": record.step, "collective": record.collective,
                            "wire_bytes": record.wire_bytes, "modeled_bits_total": record.modeled_bits_total,
                            "budget_bits_total": record.budget_bits_total, "violation": record.violation,
                            "escalations": len(record.escalations), "actions": dict(record.actions)})
    gathered = hvd.allgather_object(records, name="collective_bytes.records")
    if hvd.rank() == 0:
        steps_out = []
        for i, rec in enumerate(gathered[0]):
            others = [g[i] for g in gathered]
            for other in others:            # everything but wire_bytes is identical on every rank
                if {k: v for k, v in other.items() if k != "wire_bytes"} != {k: v for k, v in rec.items()
                                                                             if k != "wire_bytes"}:
                    raise RuntimeError(f"ranks disagree on a step record: {rec} vs {other}")
            steps_out.append({**rec, "wire_bytes": [g[i]["wire_bytes"] for g in gathered]})
        result = {"ranks": hvd.size(), "transport": "gloo", "parameters": parameters, "tensors": tensors,
                  "budgets": list(budgets), "steps_per_budget": steps,
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "steps": steps_out}
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
        for s in steps_out:
            print(f"np {hvd.size()} budget {s['budget']} step {s['step']}: {s['collective']}, wire bytes "
                  f"{s['wire_bytes']}, modeled bits/8 {s['modeled_bits_total'] / 8:.0f}", flush=True)
    hvd.shutdown()


# ---------------------------------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", action="store_true", help="print the modeled tables (pure computation)")
    parser.add_argument("--measure", action="store_true", help="launch horovodrun --gloo and measure")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="-np of each measured launch (2)")
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS), help="SafeBits budget_bits")
    parser.add_argument("--steps", type=int, default=5, help="training steps per budget (5)")
    parser.add_argument("--tensor-elements", type=int, default=TENSOR_ELEMENTS,
                        help="tensor size of the header note (1,000,000)")
    parser.add_argument("--json", default=None, help="measured JSON (default results/collective_bytes_np{N}.json)")
    parser.add_argument("--out", default=None, help="also write the markdown here")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per horovodrun launch (120)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        worker(args.budgets, args.steps, args.json)
        return 0
    if not (args.table or args.measure):
        parser.error("pass --table and/or --measure")
    parts: list[str] = []
    status = 0
    if args.table:
        parts.append(table_markdown(elements=args.tensor_elements))
    if args.measure:
        results = []
        for ranks in args.ranks:
            default = ROOT / "results" / f"collective_bytes_np{ranks}.json"
            json_path = Path(args.json.format(N=ranks)) if args.json else default
            result = run_measure(ranks, args.budgets, args.steps, json_path, args.timeout)
            results.append(result)
            print(f"np {ranks}: {json_path} ({result['launch_wall_s']} s)", file=sys.stderr)
            problems = check_steps(result["steps"], ranks, result["parameters"])
            for problem in problems:
                print(f"MISMATCH: {problem}", file=sys.stderr)
            status = status or (1 if problems else 0)
        summary = ", ".join(f"np {r['ranks']}: {r['launch_wall_s']} s" for r in results)
        parts.append(f"Measured (horovodrun --gloo; MLP of {results[0]['parameters']:,} parameters in "
                     f"{results[0]['tensors']} tensors; {args.steps} steps per budget; last step shown; "
                     f"OMP_NUM_THREADS={results[0]['omp_num_threads']}; {summary}). Wire bytes per rank from "
                     f"`StepRecord.wire_bytes`, one figure if equal on every rank; sent per rank (model) = wire "
                     f"bytes x (P - 1) for allgather, x 2 (P - 1) / P for dense:\n\n" + measured_markdown(results))
    text = "\n".join(parts)
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
