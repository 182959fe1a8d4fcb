# The two commands a new user needs (see README):
#   make demo   set up, then run the main job on the embedded default workload
#   make test   set up, then run every test, Rust and Python
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup setup-test demo test test-rust test-python bench

setup:
	$(PIP) install -q "maturin>=1.7,<2"
	$(PIP) install -q -e ".[plot]"

setup-test:
	$(PIP) install -q "maturin>=1.7,<2"
	$(PIP) install -q -e ".[test]"

demo: setup
	$(PYTHON) -m eldr_sglang demo

test: setup-test test-rust test-python

test-rust:
	cargo test --workspace

test-python:
	$(PYTHON) -m pytest -q

bench:
	cargo bench -p eldr-core --bench route
	$(PYTHON) benchmarks/bench_router.py
