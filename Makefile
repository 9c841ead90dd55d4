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

train: setup
	$(VENV)/bin/meshtrain train

test: setup
	$(PY) -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check src tests

bench: setup
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(VENV)/bin/meshtrain bench

clean:
	rm -rf $(VENV) runs .pytest_cache
