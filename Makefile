# Quick start: `make train` (set up, then run the demo) and `make test` (set up, then the suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.meshtrain-installed

.PHONY: setup train test lint clean bench

setup: $(STAMP)

# Creates the virtual environment, installs torch (the CPU build where no CUDA is present; an
# already installed torch is left alone), then this package with its test extras.
$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	TORCH_VERSION=$(TORCH_VERSION) sh scripts/install_torch.sh $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# The demo: 8 CPU processes, dp 2 × tp 2 × pp 2 with a Mixture-of-Experts model at ep 2, then a
# sample from the trained weights. `make train DEMO_CONFIG=configs/demo.toml` for one process.
# Each `make train` starts the demo over (--overwrite: the run directory holds one run).
DEMO_CONFIG ?= configs/4d_moe.toml
DEMO_RUN_DIR ?= runs/demo

train: setup
	$(VENV)/bin/meshtrain train --config $(DEMO_CONFIG) --run-dir $(DEMO_RUN_DIR) --overwrite
	OMP_NUM_THREADS=1 $(VENV)/bin/meshtrain generate --checkpoint $(DEMO_RUN_DIR) --prompt "def " \
		--max-new-tokens 160 --temperature 0.7

test: setup
	$(PY) -m pytest -q -m 'not slow' --durations=25 tests

lint: setup
	$(VENV)/bin/ruff check src tests

bench: setup
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) -m pytest -q -m slow tests
	$(VENV)/bin/meshtrain bench

clean:
	rm -rf $(VENV) runs .pytest_cache
