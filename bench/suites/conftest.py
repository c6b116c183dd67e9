"""pytest configuration of the benchmark suites (``pytest bench``).

Collection: the suites are ``bench/suites/bench_*.py`` (pytest's default ``python_files`` is ``test_*.py``, so this
conftest collects them unless the ini configuration already does).
Markers: ``full`` marks long cases that ``make bench-smoke`` (``-m "not full"``) leaves out.
Convention for ``extra_info`` (read by ``bench.suites.check_regression``): keys ending in ``_vs_clone`` or
``_vs_reference`` are time ratios (lower is better); ``compression_ratio`` is 32 bits over modeled bits per
element (higher is better). Absolute times are never compared.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "full: long benchmark cases, excluded from make bench-smoke")
    json_path = config.getoption("benchmark_json", default=None)   # e.g. results/bench.json in a clean clone
    json_path = getattr(json_path, "name", json_path)   # newer pytest-benchmark opens the file itself
    if isinstance(json_path, (str, os.PathLike)):
        os.makedirs(os.path.dirname(os.path.abspath(os.fspath(json_path))), exist_ok=True)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """Collect ``bench_*.py`` as test modules (their tests are ``test_*`` functions)."""
    if file_path.suffix != ".py" or not fnmatch.fnmatch(file_path.name, "bench_*.py"):
        return None
    if parent.session.isinitpath(file_path) or any(
            fnmatch.fnmatch(file_path.name, pattern) for pattern in parent.config.getini("python_files")):
        return None         # named on the command line, or matched by the ini: pytest collects it already
    return pytest.Module.from_parent(parent, path=file_path)
