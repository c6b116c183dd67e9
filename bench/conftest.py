"""pytest configuration of the benchmark suites (``pytest bench``).

Markers: ``full`` marks long cases that ``make bench-smoke`` (``-m "not full"``) leaves out.
Convention for ``extra_info`` (read by ``bench/check_regression.py``): keys ending in ``_vs_clone`` or
``_vs_reference`` are time ratios (lower is better); ``compression_ratio`` is 32 bits over modeled bits per
element (higher is better). Absolute times are never compared.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "full: long benchmark cases, excluded from make bench-smoke")
