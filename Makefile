# SafeBits. `make demo` and `make test` set everything up themselves (scripts/setup.sh, idempotent).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export SAFEBITS_REQUIRE_NVRTC := 1
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup test test-long demo demo-full lint unit mpi mpi-slow ddp trainers bench bench-smoke bench-link clean

setup:
	@bash scripts/setup.sh

test: setup lint unit mpi ddp trainers bench-smoke

# The long checks (a 10,000-step memory run under horovodrun); CI runs them after `make test` (.ci/run).
test-long: setup mpi-slow

lint: setup
	$(VENV)/bin/ruff check .

unit: setup
	$(PY) -m pytest tests -q

mpi: setup
	$(PY) -m pytest mpi_tests -q -m "not slow"

mpi-slow: setup
	$(PY) -m pytest mpi_tests -q -m slow

# The DDP front end under torchrun (Gloo), 2 and 4 ranks.
ddp: setup
	$(PY) -m pytest ddp_tests -q

# SafeBits' DDP hook through PyTorch Lightning and Hugging Face Accelerate (Gloo, 2 ranks; the trainers extra).
trainers: setup
	$(PY) -m pytest trainer_tests -q

# The regression gate: a ratio more than 2x its baseline fails, unless a second run of the suites clears it (ratios
# of sub-millisecond kernels to a clone swing 2x on a shared 2-core machine; a real regression persists).
SMOKE := $(PY) -m pytest bench/suites -q --benchmark-enable --benchmark-min-rounds=3 --benchmark-max-time=0.05 -m "not full"
bench-smoke: setup
	$(SMOKE) --benchmark-json=results/bench.json
	$(PY) -m bench.suites.check_regression results/bench.json bench/suites/baseline.json || { \
	  echo "bench-smoke: running the suites once more"; $(SMOKE) --benchmark-json=results/bench-again.json && \
	  $(PY) -m bench.suites.check_regression results/bench-again.json bench/suites/baseline.json; }

bench: setup
	$(PY) -m pytest bench/suites -q --benchmark-enable --benchmark-json=results/bench-full.json

bench-link: setup
	$(PY) -m bench.link

demo: setup
	$(PY) -m bench.demo

demo-full: setup
	$(PY) -m bench.demo --full

clean:
	rm -rf $(VENV) results .pytest_cache .ruff_cache
