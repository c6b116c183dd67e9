"""One way to start ``horovodrun`` (and ``torchrun``, for the DDP front end) from Python: used by the MPI and DDP
tests, the benchmarks and the demo.

Every launch runs in its own process group with a hard timeout (a hang becomes :class:`LaunchError`, and the
launcher and every rank it started are killed), with the environment a root container needs, and with
``OMP_NUM_THREADS`` set to cores / ranks unless the caller sets it: 2 ranks on 2 cores with default threading
run every compressor several times slower (docs/RESULTS.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class LaunchError(RuntimeError):
    """``horovodrun`` exited non-zero or ran past its timeout; ``output`` holds what the ranks printed."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(f"{message}\n{output[-8000:]}")
        self.output = output


def exit_without_finalization(code: int) -> None:
    """The end of a launched rank whose results are all printed: flush, then leave without interpreter finalization.

    A collective library's worker thread may still be releasing the last collective's tensors when Python
    finalizes; if it holds the only reference to a tensor Python created, the release takes the GIL, which a
    finalizing interpreter refuses by ending the thread: "terminate called without an active exception" (SIGABRT)
    after every result was printed, in about 1 of 20 DDP launches here (core dump: ``ProcessGroupGloo::runLoop``
    destroying an ``AsyncAllgatherWork``; a PyTorch issue, not SafeBits'). Horovod ops left pending on purpose
    make a normal exit unsafe for the same reason."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def horovodrun_path() -> str | None:
    """``horovodrun`` next to this Python (the virtual environment's), else on PATH, else None."""
    local = Path(sys.executable).parent / "horovodrun"
    return str(local) if local.exists() else shutil.which("horovodrun")


def launch_env(ranks: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a launch: root allowed, idle MPI ranks yield the cores, the repository importable,
    and one OpenMP thread per rank's share of the cores (unless ``OMP_NUM_THREADS`` is already set)."""
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, ranks))))
    if extra:
        env.update(extra)
    return env


def horovodrun_command(ranks: int, script: str | os.PathLike[str], *args: str, transport: str = "gloo",
                       prefix: Sequence[str] = (), elastic: tuple[int, str] | None = None) -> list[str]:
    """``[*prefix, horovodrun, -np, ranks, -H, localhost:ranks, --transport, python, script, *args]``; with
    ``elastic=(min_ranks, discovery_script)``, ``--min-np min_ranks --max-np ranks --host-discovery-script
    discovery_script`` take the place of ``-H``."""
    if transport not in ("gloo", "mpi"):
        raise ValueError(f"transport must be 'gloo' or 'mpi', got {transport!r}")
    runner = horovodrun_path()
    if runner is None:
        raise LaunchError("horovodrun is not installed (run scripts/setup.sh)", "")
    hosts = ["-H", f"localhost:{ranks}"]
    if elastic is not None:
        min_ranks, discovery_script = elastic
        hosts = ["--min-np", str(min_ranks), "--max-np", str(ranks), "--host-discovery-script", discovery_script]
    return [*prefix, runner, "-np", str(ranks), *hosts, f"--{transport}", sys.executable, os.fspath(script), *args]


def horovodrun(ranks: int, script: str | os.PathLike[str], *args: str, transport: str = "gloo",
               timeout: float = 600, env: Mapping[str, str] | None = None, prefix: Sequence[str] = (),
               on_line: Callable[[str], None] | None = None, elastic: tuple[int, str] | None = None) -> str:
    """Run ``script`` on ``ranks`` local ranks under ``horovodrun``; return everything the ranks printed.

    Args:
        ranks: number of processes (``-np``), all on localhost.
        script, args: the Python program each rank runs, and its arguments.
        transport: ``"gloo"`` or ``"mpi"``.
        timeout: seconds before the launch is killed and :class:`LaunchError` raised.
        env: variables added to :func:`launch_env`'s environment.
        prefix: command words before ``horovodrun`` (``["ip", "netns", "exec", "ns"]`` to run in a namespace).
        on_line: called with each output line as it arrives (progress printing).
        elastic: ``(min_ranks, discovery_script)`` for an elastic launch of ``ranks`` at most (see
            :func:`horovodrun_command`).

    Raises:
        LaunchError: on a non-zero exit or a timeout.
    """
    command = horovodrun_command(ranks, script, *args, transport=transport, prefix=prefix, elastic=elastic)
    return run_launch(command, ranks, timeout, env, on_line)


def torchrun_command(ranks: int, script: str | os.PathLike[str], *args: str,
                     prefix: Sequence[str] = ()) -> list[str]:
    """``[*prefix, python, -m, torch.distributed.run, --standalone, --nproc_per_node, ranks, script, *args]``
    (``--standalone``: a free local port per launch, so launches running at the same time never meet)."""
    return [*prefix, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(ranks), os.fspath(script), *args]


def torchrun(ranks: int, script: str | os.PathLike[str], *args: str, timeout: float = 600,
             env: Mapping[str, str] | None = None, prefix: Sequence[str] = (),
             on_line: Callable[[str], None] | None = None) -> str:
    """Run ``script`` on ``ranks`` local ranks under ``torchrun`` (the DDP tests and benchmark); as
    :func:`horovodrun` otherwise."""
    return run_launch(torchrun_command(ranks, script, *args, prefix=prefix), ranks, timeout, env, on_line)


def run_launch(command: list[str], ranks: int, timeout: float, env: Mapping[str, str] | None,
               on_line: Callable[[str], None] | None) -> str:
    """Run one launcher ``command`` in its own process group; its output, or :class:`LaunchError` on a non-zero
    exit or after ``timeout`` seconds (the launcher and every rank killed)."""
    proc = subprocess.Popen(command, cwd=REPO, env=launch_env(ranks, env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    lines: list[str] = []
    timed_out = False

    def on_alarm() -> None:
        nonlocal timed_out
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)       # the launcher and every rank it started

    timer = threading.Timer(timeout, on_alarm)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))
        code = proc.wait()
    finally:
        timer.cancel()
    output = "".join(lines)
    shown = " ".join(command)
    if timed_out:
        raise LaunchError(f"timeout after {timeout:.0f}s (a hang?): {shown}", output)
    if code != 0:
        raise LaunchError(f"exit status {code}: {shown}", output)
    return output
