# One virtual environment in .venv/, CPU torch first (a bare `torch` requirement
# would pull a multi-GB CUDA build), then the package in editable mode with dev extras.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test lint bench clean

install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'

test:
	$(BIN)/pytest

lint:
	$(BIN)/ruff check kvstore tiers predictor client bench tests

bench:
	mkdir -p bench/out
	$(BIN)/python bench/tiers.py --json > bench/out/tiers.json

clean:
	rm -rf $(VENV) build dist *.egg-info
