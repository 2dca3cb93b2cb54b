# One virtual environment in .venv/, CPU torch first (a bare `torch` requirement
# would pull a multi-GB CUDA build), then the package in editable mode with dev extras.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test lint typecheck bench serve clean

install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'

test:
	$(BIN)/pytest

lint: typecheck
	$(BIN)/ruff check kvstore tiers predictor client bench tests

# mypy cannot follow setuptools' package-dir mapping (tiers/ -> kvstore.tiers),
# so it checks a tree of symlinks laid out as the installed package is.
# TYPECHECK_ROOT lets several checkouts or agents typecheck at once without sharing a tree.
TYPECHECK_ROOT ?= build/typecheck
TYPECHECK := $(TYPECHECK_ROOT)/kvstore
typecheck:
	rm -rf $(TYPECHECK_ROOT) && mkdir -p $(TYPECHECK)
	ln -s $(CURDIR)/kvstore/*.py $(TYPECHECK)/
	ln -s $(CURDIR)/kvstore/server $(TYPECHECK)/server
	ln -s $(CURDIR)/tiers $(TYPECHECK)/tiers
	ln -s $(CURDIR)/predictor $(TYPECHECK)/predictor
	ln -s $(CURDIR)/client $(TYPECHECK)/client
	$(BIN)/mypy $(TYPECHECK)

serve:
	$(BIN)/kvstore serve

bench:
	mkdir -p bench/out
	$(BIN)/python bench/tiers.py --json > bench/out/tiers.json

clean:
	rm -rf $(VENV) build dist *.egg-info
