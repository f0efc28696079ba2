# `make demo` and `make test` do all set-up themselves on a fresh machine: demo installs what dpkit needs,
# test adds the test extras (pytest, ruff, transformers, accelerate, lightning, tensorboard).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpkit-installed
# pytest-xdist workers: most tests that start processes spend their time waiting on them, so two workers keep a
# 2-core machine busy; test files are dealt out whole, the slowest first (tests/conftest.py)
TEST_WORKERS ?= 2
TEST_STAMP := $(VENV)/.dpkit-test-installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	# torch only when none is importable: here that takes the CPU build on disk, never a CUDA download
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[test]'
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/dpkit demo

# the type check runs beside the tests (one process for ~15 s, its report printed after theirs); both must pass
test: $(TEST_STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy > $(VENV)/mypy.log 2>&1 & typing=$$!; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20; tests=$$?; \
	wait $$typing; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 && test $$typed -eq 0

bench: $(STAMP)
	$(PY) benchmarks/strategies_throughput.py

clean:
	rm -rf $(VENV) runs build src/*.egg-info .ruff_cache
