"""The rate-limited link of the benchmarks: network namespaces whose loopback ``tc`` limits, and two "nodes" joined
by a limited veth pair (docs/DESIGN.md has the recipe).

:func:`limited_namespace` gives a namespace of its own whose loopback runs at a rate (``100mbit``, ``1gbit``,
``unlimited``: :func:`parse_rate`); :func:`two_nodes` two namespaces whose veth pair is limited while each one's
loopback is free; :func:`run_on_link` runs an experiment that launches its own ranks on either. ``bench.link`` and
``bench.race`` configure one namespace rate after rate (:func:`configure_link`). Root only (``ip netns``, ``tc``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

LO_MTU = 65536
"""The loopback's MTU: a tbf bucket smaller than one full-size frame (plus its link header) drops that frame."""
MIN_BURST = 2 * LO_MTU
BURST_TIME_S = 1e-3
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int | None:
    """Link rate in bits per second from tc's notation (``100mbit``, ``1gbit``, ``2.5gbit``); None for
    ``unlimited``. tc's bit-rate units are decimal (1mbit = 10**6 bit/s)."""
    text = text.strip().lower()
    if text == "unlimited":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)", text)
    if not match:
        raise ValueError(f"not a link rate: {text!r} (expected e.g. 100mbit, 1gbit, 10gbit or unlimited)")
    bps = float(match.group(1)) * _UNITS[match.group(2)]
    if bps < 1:
        raise ValueError(f"link rate must be positive: {text!r}")
    return round(bps)


def burst_bytes(rate_bps: int) -> int:
    """tbf bucket size: one millisecond at the rate, and at least two full-size loopback frames."""
    if rate_bps <= 0:
        raise ValueError(f"rate must be positive, got {rate_bps}")
    return max(math.ceil(rate_bps / 8 * BURST_TIME_S), MIN_BURST)


def tbf_command(rate_bps: int, dev: str = "lo") -> list[str]:
    """``tc`` arguments that limit what ``dev`` sends (``lo``: the namespace's loopback) to ``rate_bps``."""
    return ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bps}bit",
            "burst", str(burst_bytes(rate_bps)), "latency", "100ms"]


def run_command(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``, its output captured as text (raising on a non-zero exit when ``check``)."""
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


def in_namespace(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


def delete_namespace(ns: str) -> None:
    """Kill whatever still runs in the namespace (by pid: only processes this benchmark started there), delete it."""
    pids = run_command(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    run_command(["ip", "netns", "del", ns], check=False)


def configure_link(ns: str, rate_bps: int | None) -> str:
    """Loopback up; tbf at ``rate_bps`` or no qdisc at all (unlimited). Returns ``tc qdisc show`` of ``lo``."""
    run_command(in_namespace(ns, "ip", "link", "set", "lo", "up"))
    if rate_bps is None:
        run_command(in_namespace(ns, "tc", "qdisc", "del", "dev", "lo", "root"), check=False)   # none there is fine
    else:
        run_command(in_namespace(ns, *tbf_command(rate_bps)))
    return run_command(in_namespace(ns, "tc", "qdisc", "show", "dev", "lo")).stdout.strip()


@contextlib.contextmanager
def limited_namespace(name: str, rate: str) -> Iterator[list[str] | None]:
    """A network namespace of its own (``name`` and this process's id) whose loopback runs at ``rate`` (this
    module's syntax, or ``unlimited``); yields the command prefix that runs a launcher in it, or None where none can
    be made (not root, no iproute2), and deletes it afterwards with whatever still runs in it."""
    ns = f"{name}-{os.getpid()}"
    if os.system(f"ip netns add {ns} 2>/dev/null") != 0:
        yield None
        return
    try:
        configure_link(ns, parse_rate(rate))
        yield in_namespace(ns)
    finally:
        delete_namespace(ns)


TWO_NODE_ADDRESSES = ("10.213.0.1", "10.213.0.2")


@contextlib.contextmanager
def two_nodes(name: str, rate: str) -> Iterator[list[tuple[list[str], str]] | None]:
    """Two network namespaces, "nodes", joined by a veth pair whose ends each send at most ``rate`` (``tc``); inside
    a node ranks talk over its loopback, unlimited (an address of the node's own never leaves it). Yields per node
    the command prefix that runs in it and its veth's name (for ``GLOO_SOCKET_IFNAME``; the first node's address,
    :data:`TWO_NODE_ADDRESSES`, is the rendezvous), or None where namespaces cannot be made; deletes both after."""
    tag = f"{os.getpid() % 100000}"
    nodes = [(f"{name}{k}-{tag}", f"sbv{tag}{k}") for k in range(2)]
    if os.system(f"ip netns add {nodes[0][0]} 2>/dev/null") != 0:
        yield None
        return
    try:
        run_command(["ip", "netns", "add", nodes[1][0]])
        run_command(["ip", "link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1]])
        rate_bps = parse_rate(rate)
        for (ns, dev), address in zip(nodes, TWO_NODE_ADDRESSES, strict=True):
            run_command(["ip", "link", "set", dev, "netns", ns])
            run_command(in_namespace(ns, "ip", "addr", "add", f"{address}/24", "dev", dev))
            for link in (dev, "lo"):
                run_command(in_namespace(ns, "ip", "link", "set", link, "up"))
            if rate_bps is not None:
                run_command(in_namespace(ns, *tbf_command(rate_bps, dev)))
        yield [(in_namespace(ns), dev) for ns, dev in nodes]
    finally:
        for ns, _ in nodes:
            delete_namespace(ns)      # the veth pair goes with its namespaces


def torchrun_two_nodes(nodes: list[tuple[list[str], str]], ranks_per_node: int, module: str, args: list[str],
                       timeout: float) -> str:
    """``python -m module args`` on ``ranks_per_node`` ranks in each of :func:`two_nodes`' nodes (one ``torchrun``
    per node, a static rendezvous at the first node's address); the first node's output. Both launches are killed
    after ``timeout`` seconds; a non-zero exit raises :class:`~safebits_hvd.frontends.launch.LaunchError`."""
    from safebits_hvd.frontends.launch import REPO, LaunchError, launch_env

    port = str(29500 + os.getpid() % 1000)
    procs = []
    for rank, (prefix, dev) in enumerate(nodes):
        command = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
                   "--nproc_per_node", str(ranks_per_node), "--master_addr", TWO_NODE_ADDRESSES[0],
                   "--master_port", port, "-m", module, *args]
        env = launch_env(ranks_per_node, {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": dev})
        procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired as exc:
        raise LaunchError(f"two-node launch of {module} timed out after {timeout:g} s", "".join(outputs)) from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if any(proc.returncode for proc in procs):
        raise LaunchError(f"two-node launch of {module} failed ({[p.returncode for p in procs]})", "\n".join(outputs))
    return outputs[0]


def run_on_link(name: str, argv: list[str] | None, parse_args: Callable[[list[str]], argparse.Namespace],
                worker: Callable[[argparse.Namespace], None],
                launch: Callable[[Any, list[str], argparse.Namespace], None]) -> int:
    """An experiment that launches itself on a limited link: with ``--worker`` (``args.worker``) this process is a
    rank and runs ``worker(args)``; else ``launch(link, argv, args)`` starts the ranks at ``args.rate``: ``link`` is
    the command prefix of a namespace of their own (:func:`limited_namespace`), or with ``args.nodes == 2`` the two
    nodes of :func:`two_nodes`. Returns the launcher's exit status; a rank leaves without the interpreter's
    finalization (:func:`safebits_hvd.frontends.launch.exit_without_finalization`)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        from safebits_hvd.frontends.launch import exit_without_finalization

        worker(args)
        exit_without_finalization(0)     # a collective library's threads can abort the interpreter's finalization
    with (two_nodes(name, args.rate) if getattr(args, "nodes", 1) == 2 else limited_namespace(name, args.rate)) as link:
        if link is None:
            print(f"[{name}] cannot create a network namespace: run as root with ip and tc (iproute2)")
            return 1
        launch(link, argv, args)
    return 0


def qdisc_stats(ns: str) -> str:
    return run_command(in_namespace(ns, "tc", "-s", "qdisc", "show", "dev", "lo"), check=False).stdout.strip()
