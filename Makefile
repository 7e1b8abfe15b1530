# `make demo` and `make test` each set up everything on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint format docs bench no-budget fuzz zoo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build first, pinned, so pip never pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# Type-check first (about 30 s cold), then the suite.
test: lint
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

# Format check, lint and type check (settings: [tool.ruff], [tool.mypy] in pyproject.toml).
# `make format` rewrites the files ruff format would change.
LINTED := fxremat tests benchmarks examples docs/gen_api.py

lint: $(STAMP)
	$(PY) -m ruff format --check $(LINTED)
	$(PY) -m ruff check $(LINTED)
	$(PY) -m mypy fxremat

format: $(STAMP)
	$(PY) -m ruff format $(LINTED)
	$(PY) -m ruff check --fix $(LINTED)

# Regenerate docs/API.md from the docstrings (tests/test_api_docs.py checks it is current).
docs: $(STAMP)
	$(PY) docs/gen_api.py

bench: $(STAMP)
	$(PY) benchmarks/zoo.py --setup-timm
	$(PY) benchmarks/compare.py

# No budget against eager and plain torch.compile, side by side (docs/NO_BUDGET.md; the timm rows need `make zoo`'s set-up).
no-budget: $(STAMP)
	$(PY) benchmarks/zoo.py --setup-timm
	$(PY) benchmarks/no_budget.py

# 500 random models and budgets (make test runs 15).
fuzz: $(STAMP)
	FXREMAT_FUZZ_EXAMPLES=500 $(PY) -m pytest -q tests/test_fuzz.py

# Gradients of ~40 real model families (transformers, timm) compiled whole, against eager: docs/ZOO.md.
# timm and torchvision's Python files go to $(VENV)/zoo-vendor (no second torch; see docs/ZOO.md).
zoo: $(STAMP)
	$(PY) benchmarks/zoo.py --setup-timm
	$(PY) benchmarks/zoo.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache
