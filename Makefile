# The two commands a new user needs (see README):
#   make demo   set up, then run the main job on the embedded default workload
#   make test   set up, then run every test, Rust and Python
#   make test-sglang-cpu   only the end-to-end tests on real SGLang 0.5.23 on this CPU
#                          (needs sglang==0.5.23 and the mooncake prerequisites: see README)
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup setup-test demo test test-rust test-stubs test-python test-sglang-cpu bench

setup:
	$(PIP) install -q "maturin>=1.7,<2"
	@echo "compiling the Rust extension (eldr_sglang._core; about 2 minutes the first time, silent)..."
	$(PIP) install -q -e ".[plot]"

setup-test:
	$(PIP) install -q "maturin>=1.7,<2"
	@echo "compiling the Rust extension (eldr_sglang._core; about 2 minutes the first time, silent)..."
	$(PIP) install -q -e ".[test]"

demo: setup
	$(PYTHON) -m eldr_sglang demo

test: setup-test test-rust test-stubs test-python

test-rust:
	cargo test --workspace

# the type stubs of the Rust extension (eldr_sglang/_core.pyi) against the built module
test-stubs:
	$(PYTHON) -m mypy.stubtest eldr_sglang._core

test-python:
	$(PYTHON) -m pytest -q

# fails (not skips) when a prerequisite is missing
test-sglang-cpu: setup-test
	ELDR_REQUIRE_SGLANG=1 $(PYTHON) -m pytest -q -s tests/test_sglang_cpu_harness.py tests/test_sglang_cpu_e2e.py tests/test_sglang_cpu_deepseek.py tests/test_sglang_cpu_locality.py tests/test_sglang_cpu_layouts.py

bench:
	cargo bench -p eldr-core --bench route
	$(PYTHON) benchmarks/bench_router.py
