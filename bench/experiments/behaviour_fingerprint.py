"""Behaviour fingerprint of SafeBits and the baselines: proves that a refactor changed no observable behaviour (a
check, not a figure: no section of docs/RESULTS.md).

It drives only public API (``SafeBits(...)``, ``compress``, ``decompress``, ``last_step``, ``history``,
``step``, ``state_dict``, ``load_state_dict``, ``baselines.REGISTRY`` / ``make_compressor``,
``safebits_hvd.frontends.launch.horovodrun``), so the same file runs unchanged on the code before and after a refactor,
and writes a JSON file of hashes and values; ``--compare`` diffs two such files.

What it checks (in one process, no Horovod init, one thread, everything seeded):

* SafeBits on a many-tensor parameter set (sizes 7, 300, 512, 1000, 5000, 70000, 3, a 2-D 17x33 tensor and a
  frozen tensor) with fresh heavy-tailed random gradients (set as ``p.grad``) for 12 steps, in the configs of
  :func:`safebits_configs` (budgets 2, 4.4, 8, 32; ``screen=False``; a ``ConvergenceRamp`` and an ``SNRAware``
  schedule; ``nonfinite="skip"`` with a NaN and an Inf injected; custom menus; ``max_history=3``; tight thresholds
  that escalate; another seed; Horovod's call order of all compresses before all decompresses; the allgather path,
  whose step is batched per fusion group, and the two-phase path, with their one-process transport). Per step and
  tensor: SHA-256 of the sent tensor (``compress`` output: dtype, shape, bytes) and of the ``decompress`` output;
  per step every :class:`~safebits_hvd.StepRecord` field read by attribute (floats as ``repr``, so NaN-safe),
  ``step`` and the history length; at the end the history, the whole ``state_dict`` (tensors hashed) and one
  hash of its residuals; then ``state_dict`` -> ``torch.save``/``torch.load`` -> a fresh object ->
  ``load_state_dict`` -> 3 more steps, fingerprinted the same way (and checked against the original object
  continuing uninterrupted).
* Every compressor of ``baselines.REGISTRY`` (budgeted ones at 4.4 bits) the same way for 6 steps; record fields
  that a compressor lacks read as ``"<missing>"``.
* A small real training loop (2-layer MLP, fixed random data, SGD with momentum) driven through
  ``compress``/``decompress`` by hand: per-step loss and record, the final parameters' hashes.

With ``--horovod`` it launches itself on ``--np`` ranks (default 2: the allgather path; 4: two-phase; ``horovodrun``,
Gloo) through :mod:`safebits_hvd.frontends.launch`; each rank trains a small MLP with ``hvd.DistributedOptimizer(...,
compression=...)`` for 10 steps with SafeBits at 2 and 4.4 bits, the ``qsgd4`` baseline, and SafeBits with
``backward_passes_per_step=2``; rank 0 writes per step the SHA-256 of every parameter and reduced gradient, the
record fields, and every rank's parameter hash (which must agree). About 15-40 s.

The ``meta`` section (package path, versions, kernel backend) is informational and not compared: it differs
between a worktree and the main checkout. Run (from the repository root)::

    .venv/bin/python -m bench.experiments.behaviour_fingerprint --out /tmp/fp_after.json
    .venv/bin/python -m bench.experiments.behaviour_fingerprint --horovod --out /tmp/fp_after_hvd.json
    .venv/bin/python -m bench.experiments.behaviour_fingerprint --compare /tmp/fp_before.json /tmp/fp_after.json

``--compare`` prints the first differences (JSON path of each) and exits 1, or prints
``identical: N values compared`` and exits 0.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"     # before torch and the C kernels load: one thread, run to run identical

import argparse
import hashlib
import io
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# The package comes from PYTHONPATH (another checkout: PYTHONPATH=/path/to/it) or the installed one.
import safebits_hvd as sb
from safebits_hvd.frontends import baselines

Params = list[tuple[str, nn.Parameter]]
Factory = Callable[[Params], Any]

RECORD_FIELDS = ("step", "budget_bits_total", "used_bits_total", "compression_ratio", "violation", "excess_bits",
                 "escalations", "actions", "distortion", "cosine", "allocation_digest", "allocated", "skipped",
                 "infeasible")
MISSING = "<missing>"
SIZES = (7, 300, 512, 1000, 5000, 70_000, 3)
SAFEBITS_STEPS = 12
BASELINE_STEPS = 6
RESTORE_STEPS = 3
HVD_STEPS = 10


# ---------------------------------------------------------------------------------------------------- values
def tensor_hash(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (any dtype, any device, any layout)."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def norm(value: Any) -> Any:
    """A JSON-exact form: floats as ``repr`` (NaN and Inf safe), tensors and arrays as hashes, containers
    recursively, anything else as ``type:repr``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return f"float:{float(value)!r}"
    if isinstance(value, torch.Tensor):
        return f"tensor:{tensor_hash(value)}"
    if isinstance(value, np.ndarray):
        return f"tensor:{tensor_hash(torch.from_numpy(np.ascontiguousarray(value)))}"
    if isinstance(value, dict):
        return {str(k): norm(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [norm(v) for v in value]
    return f"{type(value).__name__}:{value!r}"


def record_fields(record: Any) -> Any:
    """Every :data:`RECORD_FIELDS` of a step record, read by attribute (``"<missing>"`` if absent)."""
    if record is None:
        return None
    return {f: norm(getattr(record, f, MISSING)) for f in RECORD_FIELDS}


def history_of(compressor: Any) -> Any:
    history = getattr(compressor, "history", None)
    return None if history is None else list(history)


def state_fingerprint(compressor: Any) -> dict[str, Any]:
    """The whole ``state_dict`` (tensors hashed) and one hash over its residuals (sorted by name)."""
    state = compressor.state_dict()
    residuals = state.get("residuals", {})
    h = hashlib.sha256()
    for name in sorted(residuals):
        h.update(f"{name}|{tensor_hash(residuals[name])}|".encode())
    return {"state_dict": norm(state), "residuals_sha256": h.hexdigest()}


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}:{record.name}:{record.getMessage()}")


@contextmanager
def captured_logs() -> Iterator[list[str]]:
    """The messages of the ``safebits_hvd`` loggers while the block runs (also part of the behaviour)."""
    handler = _Collect()
    logger = logging.getLogger("safebits_hvd")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


# ---------------------------------------------------------------------------------------------------- inputs
def many_tensor_params(seed: int = 0) -> Params:
    """Assorted 1-D sizes (partial buckets, many buckets), a 2-D tensor, and a frozen one (must be ignored)."""
    gen = torch.Generator().manual_seed(seed)
    params = [(f"p{i}", nn.Parameter(torch.randn(n, generator=gen))) for i, n in enumerate(SIZES)]
    params.append(("w2d", nn.Parameter(torch.randn(17, 33, generator=gen))))
    params.append(("frozen", nn.Parameter(torch.randn(11, generator=gen), requires_grad=False)))
    return params


def random_grads(params: Params, step: int, seed: int = 1,
                 inject: dict[tuple[int, str], float] | None = None) -> None:
    """Fresh heavy-tailed random gradients (new tensors, as ``set_to_none`` leaves them) for the trainable
    parameters; ``inject[(step, name)] = value`` puts ``value`` (NaN, Inf) into element 0 of that gradient."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    for i, (name, p) in enumerate(params):
        if not p.requires_grad:
            continue
        g = torch.randn(p.shape, generator=gen) * (1 + i) * (1.0 + 0.25 * math.sin(step))
        g = g * torch.rand(p.shape, generator=gen).pow(3)         # heavier tails than Gaussian
        if inject and (step, name) in inject:
            g.view(-1)[0] = inject[(step, name)]
        p.grad = g


# ---------------------------------------------------------------------------------------------------- driving
def run_steps(compressor: Any, params: Params, steps: range, seed: int = 1, batched: bool = False,
              inject: dict[tuple[int, str], float] | None = None) -> list[dict[str, Any]]:
    """Compress every gradient (backward order) for each step of ``steps``; the fingerprint of each step.
    ``batched``: every compress of the step before any decompress (Horovod's order), else one after the other."""
    trainable = [(n, p) for n, p in params if p.requires_grad]
    out = []
    for step in steps:
        random_grads(params, step, seed, inject)
        sent_hash: dict[str, str] = {}
        dec_hash: dict[str, str] = {}
        pending = []
        for name, p in reversed(trainable):
            sent, ctx = compressor.compress(p.grad)
            sent_hash[name] = tensor_hash(sent)
            if batched:
                pending.append((name, sent, ctx))
            else:
                dec_hash[name] = tensor_hash(compressor.decompress(sent, ctx))
        for name, sent, ctx in pending:
            dec_hash[name] = tensor_hash(compressor.decompress(sent, ctx))
        history = history_of(compressor)
        out.append({"sent": sent_hash, "decompressed": dec_hash,
                    "record": record_fields(getattr(compressor, "last_step", MISSING)),
                    "compressor_step": norm(getattr(compressor, "step", MISSING)),
                    "history_len": None if history is None else len(history)})
    return out


def fingerprint_compressor(factory: Factory, steps: int, seed: int = 1, batched: bool = False,
                           inject: dict[tuple[int, str], float] | None = None) -> dict[str, Any]:
    """Run ``steps`` steps, then save/restore into a fresh object and run :data:`RESTORE_STEPS` more."""
    params = many_tensor_params()
    with captured_logs() as logs:
        compressor = factory(params)
        result: dict[str, Any] = {"steps": run_steps(compressor, params, range(steps), seed, batched, inject)}
        history = history_of(compressor)
        result["history"] = None if history is None else [record_fields(r) for r in history]
        result["end_state"] = state_fingerprint(compressor)

        buffer = io.BytesIO()
        torch.save(compressor.state_dict(), buffer)
        buffer.seek(0)
        restored = factory(params)
        restored.load_state_dict(torch.load(buffer, weights_only=True))
        more = range(steps, steps + RESTORE_STEPS)
        result["restored"] = {"compressor_step": norm(getattr(restored, "step", MISSING)),
                              "steps": run_steps(restored, params, more, seed, batched, inject),
                              "end_state": state_fingerprint(restored)}
        straight = run_steps(compressor, params, more, seed, batched, inject)     # the original, uninterrupted
    strip = ("sent", "decompressed", "record")
    result["restored"]["matches_uninterrupted"] = all(
        {k: a[k] for k in strip} == {k: b[k] for k in strip}
        for a, b in zip(result["restored"]["steps"], straight, strict=True))
    result["logs"] = logs
    return result


def safebits_configs() -> dict[str, Factory]:
    """Name -> factory of a SafeBits object on the given parameters (a fresh schedule each time)."""
    def make(schedule: Callable[[], Any] | None = None, **kwargs: Any) -> Factory:
        def factory(params: Params) -> Any:
            if schedule is not None:
                kwargs["budget_bits"] = schedule()       # a fresh schedule object for every SafeBits
            return sb.SafeBits(params, **kwargs)
        return factory

    return {
        "budget2": make(budget_bits=2.0),
        "budget4.4": make(budget_bits=4.4),
        "budget8": make(budget_bits=8.0),
        "budget32": make(budget_bits=32.0),
        "budget4.4_unscreened": make(budget_bits=4.4, screen=False),
        "budget2_unscreened": make(budget_bits=2.0, screen=False),
        "ramp_linear": make(schedule=lambda: sb.ConvergenceRamp(2.0, 8.0, 10)),
        "ramp_cosine": make(schedule=lambda: sb.ConvergenceRamp(1.5, 6.0, 6, shape="cosine")),
        "snr_aware": make(schedule=lambda: sb.SNRAware(min_bits=2.0, max_bits=8.0, initial_bits=4.0)),
        "nonfinite_skip": make(budget_bits=4.4, nonfinite="skip"),
        "menu_names": make(budget_bits=4.4, menu=["fp32", "bf16", "int4", "int2", "sign", "topk10"]),
        "menu_bucket256": make(budget_bits=3.0,
                               menu=sb.make_menu(["fp32", "fp16", "int8", "int4", "ternary", "topk1"],
                                                 bucket_size=256)),
        "max_history3": make(budget_bits=4.4, max_history=3),
        "tight_thresholds": make(budget_bits=1.5, max_distortion=0.05, min_cosine=0.97),
        "loose_thresholds_seed7": make(budget_bits=2.5, max_distortion=1.0, min_cosine=0.0, seed=7,
                                       sample_buckets=4),
        "budget4.4_horovod_order": make(budget_bits=4.4),
        # The allgather path in one process (the batched step: fusion groups, kernels.pack_group/decode_group).
        "allgather_budget2": make(budget_bits=2.0, collective="allgather"),
        "allgather_budget4.4_horovod_order": make(budget_bits=4.4, collective="allgather"),
        "allgather_tight_thresholds": make(budget_bits=1.5, max_distortion=0.05, min_cosine=0.97,
                                           collective="allgather"),
        "allgather_unscreened": make(budget_bits=2.0, screen=False, collective="allgather"),
        "allgather_nonfinite_skip": make(budget_bits=4.4, nonfinite="skip", collective="allgather"),
        "allgather_nonfinite_propagate": make(budget_bits=4.4, collective="allgather"),
        "two_phase_budget4.4_horovod_order": make(budget_bits=4.4, collective="two_phase"),
    }


NONFINITE = {(4, "p2"): math.nan, (7, "p5"): math.inf, (9, "w2d"): -math.inf}


def safebits_section() -> dict[str, Any]:
    out = {}
    for name, factory in safebits_configs().items():
        out[name] = fingerprint_compressor(
            factory, SAFEBITS_STEPS, batched=name.endswith("horovod_order"),
            inject=NONFINITE if "nonfinite" in name else None)
    return out


def baselines_section() -> dict[str, Any]:
    budgeted = getattr(baselines, "BUDGETED", frozenset({"unscreened", "safebits"}))
    out = {}
    for name in sorted(baselines.REGISTRY):
        def factory(params: Params, name: str = name) -> Any:
            return baselines.make_compressor(name, params, seed=0,
                                             budget_bits=4.4 if name in budgeted else None)
        out[name] = fingerprint_compressor(factory, BASELINE_STEPS, seed=2)
    return out


class MLP(nn.Module):
    """Two layers, for the real training loops."""

    def __init__(self, inputs: int = 20, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def params_hashes(model: nn.Module) -> dict[str, str]:
    return {n: tensor_hash(p) for n, p in model.named_parameters()}


def training_section(steps: int = 25) -> dict[str, Any]:
    """A 2-layer MLP on fixed random data, SGD with momentum, each gradient sent through compress/decompress."""
    out = {}
    for tag, budget in (("safebits2", 2.0), ("safebits4.4", 4.4)):
        torch.manual_seed(0)
        model = MLP()
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(256, 20, generator=gen)
        y = (x @ torch.randn(20, 4, generator=gen)).argmax(dim=1)
        named = list(model.named_parameters())
        compressor = sb.SafeBits(named, budget_bits=budget)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        per_step = []
        handler = _Collect()
        logging.getLogger("safebits_hvd").addHandler(handler)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            batch = torch.arange(step * 64, step * 64 + 64) % 256
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            for _, p in reversed(named):
                sent, ctx = compressor.compress(p.grad)
                p.grad = compressor.decompress(sent, ctx).clone()
            opt.step()
            per_step.append({"loss": norm(loss.item()), "record": record_fields(compressor.last_step)})
        logging.getLogger("safebits_hvd").removeHandler(handler)
        with torch.no_grad():
            final_loss = float(nn.functional.cross_entropy(model(x), y))
        out[tag] = {"steps": per_step, "logs": handler.lines, "final_params": params_hashes(model),
                    "final_loss": norm(final_loss), "end_state": state_fingerprint(compressor)}
    return out


# ---------------------------------------------------------------------------------------------------- Horovod
HVD_SCENARIOS = (("safebits2", {"budget_bits": 2.0}, 1), ("safebits4.4", {"budget_bits": 4.4}, 1),
                 ("qsgd4", None, 1), ("safebits4.4_bpps2", {"budget_bits": 4.4}, 2))


def hvd_worker(out_path: str) -> int:
    """One rank of ``--horovod``: every scenario of :data:`HVD_SCENARIOS`; rank 0 writes ``out_path``."""
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    all_equal = True
    for tag, kwargs, bpps in HVD_SCENARIOS:
        torch.manual_seed(0)
        model = MLP()
        named = [(f"{tag}.{n}", p) for n, p in model.named_parameters()]
        if kwargs is None:
            compression = baselines.make_compressor(tag, named, seed=0)
        else:
            compression = sb.SafeBits(named, name=f"safebits.fp.{tag}", **kwargs)
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=compression,
                                       backward_passes_per_step=bpps)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        teacher = torch.randn(20, 4, generator=torch.Generator().manual_seed(12345))
        steps = []
        for step in range(HVD_STEPS):
            opt.zero_grad()
            for micro in range(bpps):
                gen = torch.Generator().manual_seed(1000 * hvd.rank() + 17 * step + micro)
                x = torch.randn(64, 20, generator=gen)
                loss = nn.functional.cross_entropy(model(x), (x @ teacher).argmax(dim=1)) / bpps
                loss.backward()
            opt.step()
            mine = params_hashes(model)
            ranks = hvd.allgather_object(mine, name=f"fp.{tag}.{step}")
            all_equal = all_equal and all(r == ranks[0] for r in ranks)
            record = record_fields(getattr(compression, "last_step", MISSING))
            records = hvd.allgather_object(record, name=f"fp.{tag}.record.{step}")
            steps.append({"params": mine, "params_by_rank": ranks,
                          "reduced_grads": {n: tensor_hash(p.grad) for n, p in named},
                          "record": record, "records_equal_across_ranks": all(r == records[0] for r in records),
                          "history_len": len(history_of(compression) or [])})
        result[tag] = {"steps": steps, "end_state_by_rank": hvd.allgather_object(
            state_fingerprint(compression), name=f"fp.{tag}.state")}
    files = hvd.allgather_object(sb.__file__, name="fp.files")
    if hvd.rank() == 0:
        payload = {"fingerprint": {"horovod": result, "ranks_agree": all_equal},
                   "meta": {"ranks": hvd.size(), "package_file_by_rank": files}}
        Path(out_path).write_text(json.dumps(payload, indent=1))
    return 0 if all_equal else 1


def run_horovod(out: Path, ranks: int) -> dict[str, Any]:
    from safebits_hvd.frontends.launch import horovodrun

    with tempfile.TemporaryDirectory() as tmp:
        worker_out = Path(tmp) / "rank0.json"
        horovodrun(ranks, os.path.abspath(__file__), "--worker", "--out", str(worker_out), transport="gloo",
                   timeout=180, env={"OMP_NUM_THREADS": "1"})
        return json.loads(worker_out.read_text())


# ---------------------------------------------------------------------------------------------------- compare
def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k in value:
            yield from leaves(value[k], f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        yield f"{path}#len", len(value)
        for i, v in enumerate(value):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def compare(a_path: str, b_path: str, show: int = 20) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    for key in sorted(set(a.get("meta", {})) | set(b.get("meta", {}))):
        va, vb = a.get("meta", {}).get(key), b.get("meta", {}).get(key)
        if va != vb:
            print(f"note (meta, not compared): {key}: {va!r} vs {vb!r}")
    la, lb = dict(leaves(a["fingerprint"])), dict(leaves(b["fingerprint"]))
    diffs = []
    for path in list(la) + [p for p in lb if p not in la]:
        if path not in lb:
            diffs.append(f"{path}: only in {a_path}: {la[path]!r}")
        elif path not in la:
            diffs.append(f"{path}: only in {b_path}: {lb[path]!r}")
        elif la[path] != lb[path]:
            diffs.append(f"{path}: {la[path]!r} != {lb[path]!r}")
    if diffs:
        for line in diffs[:show]:
            print(f"DIFF {line}"[:400])
        print(f"{len(diffs)} differences in {len(set(la) | set(lb))} values "
              f"({'first ' + str(show) + ' shown' if len(diffs) > show else 'all shown'})")
        return 1
    print(f"identical: {len(la)} values compared")
    return 0


# ---------------------------------------------------------------------------------------------------- main
def meta() -> dict[str, Any]:
    from safebits_hvd.codec import kernels

    return {"package_file": sb.__file__, "python": sys.version.split()[0], "torch": torch.__version__,
            "numpy": np.__version__, "kernel_backend": kernels.backend_name("cpu"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--horovod", action="store_true", help="fingerprint training under horovodrun")
    parser.add_argument("--np", type=int, default=2, help="ranks of --horovod (2: allgather, 4: two-phase)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        parser.error("--out is required (or --compare A B)")
    if args.worker:
        return hvd_worker(args.out)
    torch.set_num_threads(1)
    start = time.perf_counter()
    if args.horovod:
        payload = run_horovod(Path(args.out), args.np)
        payload["meta"].update(meta())
        ok = payload["fingerprint"]["ranks_agree"]
    else:
        payload = {"fingerprint": {"safebits": safebits_section(), "baselines": baselines_section(),
                                   "training": training_section()},
                   "meta": meta()}
        ok = True
    payload["meta"]["seconds"] = round(time.perf_counter() - start, 1)
    Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    count = sum(1 for _ in leaves(payload["fingerprint"]))
    print(f"wrote {args.out}: {count} values in {payload['meta']['seconds']} s "
          f"(package {payload['meta']['package_file']})")
    if not ok:
        print("ERROR: ranks disagree on the parameters", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
