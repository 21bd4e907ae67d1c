# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo quickstart test lint bench-service bench-multiplex bench-dashboard

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build.
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/multiplex.py

quickstart: $(VENV)/.installed
	$(PY) examples/quickstart.py

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

bench-service: $(VENV)/.installed
	$(PY) -m plexrl_dask.bench.service --json benchmarks/service.json

bench-multiplex: $(VENV)/.installed
	$(PY) -m plexrl_dask.bench.multiplex --jobs 4 --json benchmarks/multiplex.json

# Needs Chromium and chromedriver (Debian: apt-get install chromium chromium-driver).
bench-dashboard: $(VENV)/.installed
	$(PY) -m plexrl_dask.bench.dashboard --json benchmarks/dashboard.json --screenshots benchmarks/dashboard/synthetic
