"""Registers, spills, stack and shared memory of every CUDA kernel, as ptxas reports them, without a GPU.

NVRTC compiles :func:`cuda.cuda_source` to a cubin for a real architecture (``sm_90``) with ``ptxas -v``, so CI can
catch a kernel that starts spilling to local memory (slow on the GPU) on a CPU-only machine.
``python -m safebits_hvd.codec.kernels.resources [--arch sm_90]`` prints the table and exits 1 if any kernel spills.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NamedTuple

from . import cuda


class KernelResources(NamedTuple):
    """One kernel's line of ``ptxas -v`` (bytes are per thread, except ``shared_bytes``: static, per block)."""

    registers: int
    spill_stores_bytes: int
    spill_loads_bytes: int
    stack_bytes: int
    shared_bytes: int
    barriers: int


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """The entry functions of a ``ptxas -v`` log. A kernel's frame line follows its ``Function properties`` line
    (non-inlined device functions have one too, and are left out); its ``Used`` line follows its entry line."""
    frames: dict[str, tuple[int, int, int]] = {}
    used: dict[str, tuple[int, int, int]] = {}
    entry = properties = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
        elif m := _PROPERTIES.search(line):
            properties = m.group(1)
        elif (m := _FRAME.search(line)) and properties is not None:
            frames[properties] = (int(m.group(2)), int(m.group(3)), int(m.group(1)))     # stores, loads, stack
        elif (m := _USED.search(line)) and entry is not None:
            smem, barriers = (int(x.group(1)) if (x := r.search(line)) else 0 for r in (_SMEM, _BARRIERS))
            used[entry] = (int(m.group(1)), smem, barriers)
    return {name: KernelResources(regs, *frames.get(name, (0, 0, 0)), smem, bars)
            for name, (regs, smem, bars) in used.items()}


def kernel_resources(arch: str = "sm_90") -> dict[str, KernelResources]:
    """Compile :func:`cuda.cuda_source` with NVRTC to a cubin for ``arch`` and parse the ptxas log.

    Raises ImportError without CuPy/NVRTC and RuntimeError (with the NVRTC log) on a compile error or when ptxas
    reported nothing (a ``compute_`` arch stops at PTX and runs no ptxas)."""
    from cupy_backends.cuda.libs import nvrtc

    with cuda.nvrtc_compiled(f"--gpu-architecture={arch}", "--ptxas-options=-v") as prog:
        log = nvrtc.getProgramLog(prog)
    resources = parse_ptxas_log(log.decode() if isinstance(log, bytes) else log)
    if not resources:
        raise RuntimeError(f"no ptxas report in the NVRTC log for {arch}:\n{log}")
    return resources


def report(arch: str = "sm_90", resources: dict[str, KernelResources] | None = None) -> str:
    """A fixed-width table, one line per kernel sorted by name (``resources`` saves a compile if given)."""
    resources = kernel_resources(arch) if resources is None else resources
    width = max(len("kernel"), *map(len, resources))
    heads = ("regs", "spill st", "spill ld", "stack", "smem", "barriers")
    lines = [f"{'kernel':<{width}}" + "".join(f"{h:>10}" for h in heads) + f"   ({arch})"]
    for name in sorted(resources):
        lines.append(f"{name:<{width}}" + "".join(f"{v:>10}" for v in resources[name]))
    return "\n".join(lines)


def spilling(resources: dict[str, KernelResources]) -> list[str]:
    """The kernels that spill registers to local memory."""
    return sorted(k for k, r in resources.items() if r.spill_stores_bytes or r.spill_loads_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help="a real architecture, e.g. sm_80, sm_90 (default)")
    args = parser.parse_args(argv)
    resources = kernel_resources(args.arch)
    print(report(args.arch, resources))
    if spills := spilling(resources):
        print(f"spilling kernels: {', '.join(spills)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
