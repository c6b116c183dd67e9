"""Distortion, cosine and bits of every action, and what entropy coding of their codes would save (docs/RESULTS.md,
sections 6.1 and 6.2).

Data: Gaussian, Laplace and Student-t(3) samples, and real gradients recorded from a short single-process run of
each demo task (``bench.tasks``' ``digits_cnn`` and ``bytes_lm``: the same models, data and optimizers,
no Horovod, no compression), snapshotted at a few steps.

Per action and data set, from the C kernels' exact statistics of each whole tensor (``kernels.quantize_ef``):

* ``bits``: modeled bits per element, ``Action.cost(n) / n`` (payload body; header apart).
* ``distortion`` ``||Q(v)-v||^2 / ||v||^2`` and ``cosine`` ``cos(Q(v), v)``, pooled over the tensors (sums first).
* ``admitted``: the share of elements whose tensor passes the default screen (``max_distortion=0.5``,
  ``min_cosine=0.8``) on its own; the synthetic sets are one tensor each.
* ``frontier``: admitted on at least ``ADMITTED_SHARE`` of the elements, and no other such action is both cheaper
  and less distorting (pooled): the admissible frontier.

Entropy coding (QSGD's Elias integer coding and its ideal bound), for the scale-and-code actions (QUANT,
LLOYD_MAX, SIGN) on the recorded gradients: the same codes (so the same distortion), with the fp32 scales kept and
the codes coded per tensor as

* ``entropy``: ``n`` times the empirical entropy of the tensor's signed codes, plus ``MODEL_BITS`` per distinct code
  for the table of counts a static coder (e.g. arithmetic coding) must send: within a few bits of what such a
  coder of the symbols one at a time achieves;
* ``gamma`` / ``omega``: Elias-gamma / Elias-omega of ``|code| + 1`` plus a sign bit for non-zero codes (QSGD).

``saving`` is one minus the coded body over the packed body of the same action. For admitted actions, ``saving vs
it`` compares the best coded body with the cheapest admitted packed action at no more (pooled) distortion: what
entropy coding saves at equal distortion.

Usage: ``.venv/bin/python -m bench.experiments.action_frontier [--steps 100]
[--out results/action_frontier.json]``; prints the
markdown tables of docs/RESULTS.md. ``--lloyd-max M [M ...]`` prints the ``M``-level Lloyd-Max codebooks of a unit
Gaussian instead (Lloyd's iteration on the density: :data:`safebits_hvd.codec.actions.LLOYD_MAX_LEVELS` came from it).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
from collections.abc import Iterable
from statistics import NormalDist
from typing import Any

import torch

from bench.output import write_json
from safebits_hvd.codec import actions as A
from safebits_hvd.codec import kernels as K
from safebits_hvd.codec import rng
from safebits_hvd.codec.kernels import reference as R

MAX_DISTORTION = 0.5
MIN_COSINE = 0.8
ADMITTED_SHARE = 0.99
MODEL_BITS = 32
SYNTHETIC_N = 1 << 20
KEY = rng.stream_key(13, 0, 0)
CODED_KINDS = (A.ActionKind.QUANT, A.ActionKind.LLOYD_MAX, A.ActionKind.SIGN)


def synthetic() -> dict[str, list[tuple[str, torch.Tensor]]]:
    """One tensor of ``SYNTHETIC_N`` samples per distribution (seeded)."""
    torch.manual_seed(13)
    return {
        "gaussian": [("gaussian", torch.randn(SYNTHETIC_N))],
        "laplace": [("laplace", torch.distributions.Laplace(0.0, 1.0).sample((SYNTHETIC_N,)))],
        "student_t3": [("student_t3", torch.distributions.StudentT(3.0).sample((SYNTHETIC_N,)))],
    }


def recorded_gradients(steps: int, snapshots: int) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Gradients of every parameter at ``snapshots`` evenly spaced steps of a ``steps``-step run of each demo task
    (seed 0, one process, the demo's optimizer and learning rate)."""
    from bench import tasks as W

    at = {round(i * (steps - 1) / max(1, snapshots - 1)) for i in range(snapshots)}
    out = {}
    for name in ("digits_cnn", "bytes_lm"):
        task = W.make_task(name, steps)
        torch.manual_seed(0)
        model = task.model()
        opt = task.optimizer(model)
        gen = torch.Generator().manual_seed(0)
        grads = []
        for step in range(steps):
            opt.zero_grad()
            task.batch_loss(model, gen).backward()
            if step in at:
                grads += [(f"{step}.{pname}", p.grad.detach().reshape(-1).clone())
                          for pname, p in model.named_parameters() if p.grad is not None]
            opt.step()
        out[name] = grads
    return out


def fixed_scale_distortion(levels: int, tensors: list[tuple[str, torch.Tensor]], base: str) -> float:
    """Pooled distortion of the ``levels``-level Lloyd-Max codebook at ONE fixed scale per bucket: its RMS
    (``base="rms"``) or its mean ``|v|`` times sqrt(pi / 2) (``"mean_abs"``, the same for Gaussian data): the
    scale rules the kernels' candidate search is compared with (float64, PyTorch)."""
    mags = torch.tensor(A.lloyd_max_levels(levels), dtype=torch.float64)
    grid = torch.cat([-mags.flip(0), mags]).unique()
    err = total = 0.0
    for _, v in tensors:
        vp, j, lens = R.bucket_matrix(v, A.DEFAULT_BUCKET_SIZE)
        vp, valid = vp.double(), j < v.numel()
        if base == "rms":
            scale = (vp.pow(2).sum(dim=1) / lens).sqrt()
        else:
            scale = vp.abs().sum(dim=1) / lens * math.sqrt(math.pi / 2)
        r = vp / scale.clamp_min(1e-300)[:, None]
        q = grid[(r[..., None] - grid).abs().argmin(dim=-1)] * scale[:, None]
        err += float(torch.where(valid, (q - vp).pow(2), 0.0).sum())
        total += float(vp.pow(2).sum())
    return err / total


def measure(action: A.Action, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Pooled distortion and cosine, bits per element and the admitted share of elements."""
    err2 = qv = q2 = v2 = 0.0
    bits = n_total = admitted = 0
    for _, v in tensors:
        n = v.numel()
        s = K.quantize_ef(None, v.clone(), torch.empty(n), action, KEY).tolist()
        err2, qv, q2, v2 = err2 + s[0], qv + s[1], q2 + s[2], v2 + s[3]
        bits += action.cost(n)
        n_total += n
        d = s[0] / s[3] if s[3] > 0 else 0.0
        c = s[1] / math.sqrt(s[2] * s[3]) if s[2] > 0 and s[3] > 0 else (1.0 if s[3] == 0 else 0.0)
        admitted += n if d <= MAX_DISTORTION and c >= MIN_COSINE else 0
    return {"action": action.name, "bits": bits / n_total, "distortion": err2 / v2,
            "cosine": qv / math.sqrt(q2 * v2) if q2 > 0 else 0.0, "admitted": admitted / n_total}


def passes(row: dict[str, Any]) -> bool:
    """The screen admits the action on (nearly) every element's tensor."""
    return row["admitted"] >= ADMITTED_SHARE


def mark_frontier(rows: list[dict[str, Any]]) -> None:
    """``frontier``: rows passing the screen that no other passing row beats on bits and distortion at once."""
    ok = [r for r in rows if passes(r)]
    for r in rows:
        r["frontier"] = r in ok and not any(
            o is not r and o["bits"] <= r["bits"] and o["distortion"] <= r["distortion"]
            and (o["bits"], o["distortion"]) != (r["bits"], r["distortion"]) for o in ok)


def lloyd_max_codebook(levels: int, tolerance: float = 1e-13) -> tuple[tuple[float, ...], float]:
    """The non-negative magnitudes of the ``levels``-level (even) Lloyd-Max quantizer of a unit Gaussian and its
    mean squared error: Lloyd's iteration (thresholds at midpoints, levels at the conditional means of their cells,
    both exact for the Gaussian density)."""
    normal = NormalDist()

    def density(x: float) -> float:
        return 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)

    def cdf(x: float) -> float:
        return 1.0 if math.isinf(x) else normal.cdf(x)

    half = levels // 2
    mags = [(i + 0.5) * 4.0 / half for i in range(half)]
    for _ in range(100_000):
        edges = [0.0, *((a + b) / 2 for a, b in itertools.pairwise(mags)), math.inf]
        new = [(density(a) - density(b)) / (cdf(b) - cdf(a)) for a, b in itertools.pairwise(edges)]
        done = max(abs(x - y) for x, y in zip(new, mags, strict=True)) < tolerance
        mags = new
        if done:
            break
    edges = [0.0, *((a + b) / 2 for a, b in itertools.pairwise(mags)), math.inf]
    # E[(X - m)^2; a < X < b] = E[X^2] - 2 m E[X] + m^2 P over the cell, both halves
    error = 0.0
    for m, (a, b) in zip(mags, itertools.pairwise(edges), strict=True):
        p = cdf(b) - cdf(a)
        first = density(a) - density(b)
        second = p + (a * density(a) - (0.0 if math.isinf(b) else b * density(b)))
        error += 2 * (second - 2 * m * first + m * m * p)
    return tuple(mags), error


def signed_codes(action: A.Action, v: torch.Tensor) -> torch.Tensor:
    """The action's signed integer codes of ``v`` (what its packed body carries besides the scales), from the
    reference kernels' code functions: magnitude with the sign of q (-0 becomes 0: entropy coding need not keep it)."""
    vp, j, lens = R.bucket_matrix(v, action.bucket_size)
    valid = j < v.numel()
    if action.kind == A.ActionKind.QUANT:
        _, c, neg = R.quant_code(vp, j, action, KEY)
    elif action.kind == A.ActionKind.LLOYD_MAX:
        _, c, neg = R.lloyd_max_code(vp, lens, action)
        if not action.packs_trits:          # no zero level: codes 0..m/2-1 both signs, shift to +-(1..m/2)
            c = c + 1
    else:
        c, neg = torch.ones_like(vp), torch.where(vp >= 0, 0, 1)
    signed = torch.where(neg != 0, -c, c).to(torch.int64)
    return signed[valid]


def elias_gamma_bits(x: torch.Tensor) -> torch.Tensor:
    """Bits of the Elias-gamma code of integers ``x >= 1``: ``2 floor(log2 x) + 1``."""
    return 2 * torch.floor(torch.log2(x.double())).long() + 1


def elias_omega_bits(x: torch.Tensor) -> torch.Tensor:
    """Bits of the Elias-omega code of integers ``x >= 1`` (1 for x = 1; groups of floor(log2 x) + 1 bits while
    x > 1, x <- floor(log2 x), then the terminating 0)."""
    total = torch.ones_like(x)
    x = x.clone()
    while bool((x > 1).any()):
        big = x > 1
        lg = torch.floor(torch.log2(x.double())).long()
        total = total + torch.where(big, lg + 1, 0)
        x = torch.where(big, lg, x)
    return total


def entropy_coding(action: A.Action, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Coded body bits (entropy bound, Elias gamma, Elias omega) of the action's codes, over the packed body."""
    packed = entropy = gamma = omega = 0.0
    for _, v in tensors:
        n = v.numel()
        scales = A.SCALE_BITS * -(-n // action.bucket_size)
        codes = signed_codes(action, v)
        _, counts = torch.unique(codes, return_counts=True)
        p = counts.double() / n
        entropy += scales + float(-(counts.double() * torch.log2(p)).sum()) + MODEL_BITS * counts.numel()
        mag = codes.abs()
        sign_bits = (mag != 0).long() if action.kind != A.ActionKind.SIGN else torch.ones_like(mag)
        mag = mag if action.kind != A.ActionKind.SIGN else torch.zeros_like(mag)
        gamma += scales + float((elias_gamma_bits(mag + 1) + sign_bits).sum())
        omega += scales + float((elias_omega_bits(mag + 1) + sign_bits).sum())
        packed += action.cost(n)
    return {"action": action.name, "packed": packed, "entropy": entropy, "gamma": gamma, "omega": omega}


def table(rows: Iterable[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(c[1] for c in columns) + " |\n| " + " | ".join("---" for _ in columns) + " |\n"
    body = "".join("| " + " | ".join(format(r[c[0]], c[2]) if c[2] else str(r[c[0]]) for c in columns) + " |\n"
                   for r in rows)
    return head + body


def combined(frontier: dict[str, list[dict[str, Any]]]) -> str:
    """One row per action (ordered by bits on the first data set), one column per data set."""
    names = list(frontier)
    by_set = {name: {r["action"]: r for r in rows} for name, rows in frontier.items()}
    head = "| action | bits/elem | " + " | ".join(names) + " |\n|" + " --- |" * (len(names) + 2) + "\n"
    lines = []
    for r0 in frontier[names[0]]:
        cells = []
        for name in names:
            r = by_set[name][r0["action"]]
            cell = f"{r['distortion']:.3f} / {r['cosine']:.3f}"
            cell = f"**{cell}**" if r["frontier"] else cell
            if r["admitted"] < 1.0:
                cell += f" ({100 * r['admitted']:.1f}%)"
            cells.append(cell)
        lines.append(f"| {r0['action']} | {r0['bits']:.3f} | " + " | ".join(cells) + " |\n")
    return head + "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps of each demo task")
    parser.add_argument("--snapshots", type=int, default=5, help="steps at which gradients are recorded")
    parser.add_argument("--out", default="results/action_frontier.json")
    parser.add_argument("--lloyd-max", type=int, nargs="+", metavar="M",
                        help="print the M-level Lloyd-Max codebooks of a unit Gaussian and exit")
    args = parser.parse_args()
    if args.lloyd_max:
        for levels in args.lloyd_max:
            mags, error = lloyd_max_codebook(levels)
            print(f"{levels}: ({', '.join(f'{m:.4f}' for m in mags)}),  # mean squared error {error:.6g}")
        return
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    data = {**synthetic(), **recorded_gradients(args.steps, args.snapshots)}
    menu = list(A.ACTIONS.values())
    results: dict[str, Any] = {"steps": args.steps, "snapshots": args.snapshots, "frontier": {}, "entropy": {}}
    for name, tensors in data.items():
        rows = sorted((measure(a, tensors) for a in menu), key=lambda r: (r["bits"], r["distortion"]))
        mark_frontier(rows)
        results["frontier"][name] = rows
        elements = sum(v.numel() for _, v in tensors)
        print(f"\n### {name} ({len(tensors)} tensors, {elements} elements)\n")
        for r in rows:
            r["mark"] = "**frontier**" if r["frontier"] else ("" if passes(r) else "not admitted")
        print(table(rows, [("action", "action", ""), ("bits", "bits/elem", ".3f"),
                           ("distortion", "distortion", ".4f"), ("cosine", "cosine", ".4f"),
                           ("admitted", "tensors admitted (share of elements)", ".1%"), ("mark", "", "")]))
    print("\n### every data set: distortion / cosine (admitted share), bold = on the admissible frontier\n")
    print(combined(results["frontier"]))
    print("\n### LLOYD_MAX scale rules: pooled distortion (RMS / mean |v| x sqrt(pi/2) / the kernels' search)\n")
    rows = []
    for levels in sorted(A.LLOYD_MAX_LEVELS):
        action = A.lloyd_max(levels)
        row = {"action": action.name}
        for name, tensors in data.items():
            searched = next(r for r in results["frontier"][name] if r["action"] == action.name)["distortion"]
            row[name] = (f"{fixed_scale_distortion(levels, tensors, 'rms'):.3f} / "
                         f"{fixed_scale_distortion(levels, tensors, 'mean_abs'):.3f} / {searched:.3f}")
        rows.append(row)
    results["scale_rules"] = rows
    print(table(rows, [("action", "action", ""), *((name, name, "") for name in data)]))
    for name in ("digits_cnn", "bytes_lm"):
        tensors = data[name]
        rows = []
        packed_ok = [r for r in results["frontier"][name] if passes(r)]
        for a in menu:
            if a.kind not in CODED_KINDS:
                continue
            ec = entropy_coding(a, tensors)
            me = next(r for r in results["frontier"][name] if r["action"] == a.name)
            rival = min((r for r in packed_ok if r["distortion"] <= me["distortion"]), key=lambda r: r["bits"],
                        default=None) if passes(me) else None
            elements = sum(v.numel() for _, v in tensors)
            best = min(ec["entropy"], ec["gamma"], ec["omega"])
            ec.update(bits=me["bits"], distortion=me["distortion"],
                      entropy_saving=1 - ec["entropy"] / ec["packed"], gamma_saving=1 - ec["gamma"] / ec["packed"],
                      omega_saving=1 - ec["omega"] / ec["packed"], coded_bits=best / elements,
                      rival=rival["action"] if rival else "-",
                      vs_frontier=(1 - best / elements / rival["bits"]) if rival else float("nan"))
            rows.append(ec)
        results["entropy"][name] = rows
        print(f"\n### entropy coding, {name}\n")
        print(table(rows, [("action", "action", ""), ("bits", "packed bits", ".3f"),
                           ("distortion", "distortion", ".4f"),
                           ("entropy_saving", "entropy saves", ".1%"), ("gamma_saving", "Elias-gamma saves", ".1%"),
                           ("omega_saving", "Elias-omega saves", ".1%"), ("coded_bits", "best coded bits", ".3f"),
                           ("rival", "cheapest packed at <= distortion", ""), ("vs_frontier", "saving vs it", ".1%")]))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
