"""SafeBits' benchmarks: run from the repository root as modules (``python -m bench.link``); see bench/README.md."""
