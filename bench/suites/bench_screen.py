"""The screening pass through the real ``SafeBits.compress`` (its cost over a plain quantization pass).

One benchmark call = one full SafeBits step on one float32 tensor of ``n`` elements: allocation, the screen of
every menu action on ``v = g + e`` (``kernels.screen``, sampled buckets as SafeBits does by default, or every
bucket with ``screen=exact``), the fused quantize of the chosen action with error feedback
(``kernels.quantize_ef``), and the step record. ``extra_info['compress_vs_clone']`` is its time over the time
of ``torch.clone`` of the same tensor (both minima over rounds): the figure that the regression check compares.
"""

from __future__ import annotations

import pytest
import torch

import safebits_hvd as sb
from bench.suites.timing import measured_min, min_seconds

MENUS = {
    3: ["fp32", "int8", "sign"],
    6: ["fp32", "fp16", "int8", "int4", "ternary", "sign"],
    len(sb.DEFAULT_MENU): sb.DEFAULT_MENU.names,
}
"""Menu size (actions) -> action names."""

SIZES = [64 * 1024, 1024 * 1024, 16 * 1024 * 1024]
"""Tensor sizes in elements: 64K, 1M, 16M float32 (256 KiB .. 64 MiB)."""


def _cases():
    for n in SIZES:
        for menu_size in MENUS:
            for mode in ("sampled", "exact"):
                slow = n == SIZES[-1] and mode == "exact" and menu_size != len(sb.DEFAULT_MENU)
                marks = [pytest.mark.full] if slow else []
                yield pytest.param(n, menu_size, mode, marks=marks, id=f"{n // 1024}K-menu{menu_size}-{mode}")


@pytest.mark.parametrize("n,menu_size,mode", list(_cases()))
def test_safebits_compress_vs_clone(benchmark, n: int, menu_size: int, mode: str) -> None:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(n))
    param.grad = torch.randn(n)
    buckets = -(-n // 512)
    compression = sb.SafeBits([("w", param)], budget_bits=4.0, menu=MENUS[menu_size], seed=0,
                              sample_buckets=buckets if mode == "exact" else 64)
    grad = param.grad

    def compress_one_step() -> None:
        compression.compress(grad)

    compress_one_step()                 # step 0 (start policy); later steps allocate from statistics
    compress_s = measured_min(benchmark, compress_one_step)
    clone_s = min_seconds(lambda: torch.clone(grad), repeats=7)
    record = compression.last_step
    benchmark.extra_info.update({
        "elements": n, "menu_size": menu_size, "screen": mode, "compress_vs_clone": compress_s / clone_s,
        "compress_ms": compress_s * 1e3, "clone_ms": clone_s * 1e3, "action": record.actions["w"],
        "compression_ratio": record.modeled_compression_ratio, "backend": sb.codec.kernels.backend_name("cpu"),
    })
    assert record.modeled_bits_total > 0
