# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_INDEX ?=

.PHONY: demo quickstart test lint bench-service bench-multiplex bench-dashboard device-wheels

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build. PyPI's
	# Linux wheel of 2.13.0 is a CUDA build too: where no CPU wheel is at hand (a local
	# wheelhouse, as on CI), TORCH_INDEX=https://download.pytorch.org/whl/cpu fetches one.
	$(PY) -m pip install --quiet -c constraints.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
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

# The device machine (one GPU) has torch and transformers but not these: wheels for its Python
# 3.12, in .whl/ (ignored), carried to it with the run (see docs/deploying.md, "The GPU checks").
DEVICE_PACKAGES := dask distributed zarr numcodecs donfig google-crc32c locket partd tblib tornado zict
device-wheels: $(VENV)/.installed
	rm -rf .whl
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
		--platform manylinux1_x86_64 -d .whl \
		$(foreach p,$(DEVICE_PACKAGES),$(p)==$(shell $(PY) -c "import importlib.metadata as m; print(m.version('$(p)'))"))
