"""pytest-benchmark suites and the regression gate (``make bench``, ``make bench-smoke``)."""
