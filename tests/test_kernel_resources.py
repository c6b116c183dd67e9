"""ptxas resource report of the CUDA kernels (NVRTC, no GPU needed): every kernel is listed and none spills.

With ``SAFEBITS_REQUIRE_NVRTC=1`` a missing CuPy/NVRTC FAILS instead of skipping. ``pytest -s`` shows the report.
"""

from __future__ import annotations

import pytest

from safebits_hvd.codec.kernels import cuda_emulator, resources
from safebits_hvd.codec.kernels.resources import KernelResources

from .helpers import need_nvrtc

CANNED_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for sb_helper
ptxas         .     16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'sb_fast_kernel' for 'sm_90'
ptxas info    : Function properties for sb_fast_kernel
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 9312 bytes smem
ptxas info    : Compile time = 114.337 ms
ptxas info    : Compiling entry function 'sb_spill_kernel' for 'sm_90'
ptxas info    : Function properties for sb_spill_kernel
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers
ptxas info    : Compile time = 3.115 ms
"""



def test_parse_ptxas_log():
    parsed = resources.parse_ptxas_log(CANNED_LOG)
    assert parsed == {"sb_fast_kernel": KernelResources(40, 0, 0, 0, 9312, 1),
                      "sb_spill_kernel": KernelResources(255, 8, 12, 24, 0, 0)}
    assert resources.spilling(parsed) == ["sb_spill_kernel"]
    table = resources.report("sm_90", parsed).splitlines()
    assert [line.split()[0] for line in table[1:]] == ["sb_fast_kernel", "sb_spill_kernel"]
    assert table[2].split()[1:] == ["255", "8", "12", "24", "0", "0"]


def test_every_kernel_reported_and_none_spills():
    need_nvrtc()
    declared = set(cuda_emulator.kernels())          # every kernel cuda_kernels.cu declares
    assert len(declared) >= 14, declared
    found = resources.kernel_resources("sm_90")
    table = resources.report("sm_90", found)
    print("\n" + table)
    assert set(found) == declared
    listed = {line.split()[0] for line in table.splitlines()[1:]}
    assert listed == declared
    assert resources.spilling(found) == [], table


def test_main_exits_1_when_a_kernel_spills(monkeypatch, capsys):
    monkeypatch.setattr(resources, "kernel_resources", lambda arch: resources.parse_ptxas_log(CANNED_LOG))
    assert resources.main(["--arch", "sm_90"]) == 1
    assert "sb_spill_kernel" in capsys.readouterr().err
    fast = {k: v for k, v in resources.parse_ptxas_log(CANNED_LOG).items() if k == "sb_fast_kernel"}
    monkeypatch.setattr(resources, "kernel_resources", lambda arch: fast)
    assert resources.main([]) == 0


def test_compile_error_raises_with_log(monkeypatch):
    need_nvrtc()
    monkeypatch.setattr(resources.cuda, "cuda_source", lambda: "__global__ void k() { undeclared_name; }\n")
    with pytest.raises(RuntimeError, match="undeclared_name"):
        resources.kernel_resources("sm_90")
