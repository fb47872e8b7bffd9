# Everything the project needs is installed from here; nothing by hand.
#   make demo   - install, then run the gateway on an embedded default (two local vLLM CPU
#                 replicas with a tiny model built on first run); Ctrl-C stops everything
#   make test   - install the test dependencies and run every tier (lint, types, unit, e2e,
#                 cache with real Redis, integration with real vLLM)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test install install-dev vllm-env redis-server litellm-env portkey-env lint typecheck \
        test-fast bench-overhead bench-routing bench-cache tracing-ui check-dashboard clean

# Every pip call through which torch can enter goes through deploy/local/torch-index.sh: it adds
# PyTorch's CPU wheel index (TORCH_INDEX, default https://download.pytorch.org/whl/cpu; a mirror
# works, empty turns it off) when that index answers, and otherwise accepts only a CPU torch that
# pip finds locally (PIP_FIND_LINKS). `make install TORCH_INDEX=https://my-mirror/whl/cpu`.
TORCH_PIP := bash deploy/local/torch-index.sh

# The gateway with its semantic cache (what `make demo` needs besides vLLM). torch is pinned
# to the CPU build first, so nothing pulls a CUDA build.
$(VENV)/.core: pyproject.toml deploy/local/torch-index.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(TORCH_PIP) torch $(BIN)/python -q
	$(TORCH_PIP) pip $(BIN)/python -q -e '.[cache]'
	touch $@

# Everything: plus the offline tools' extra (training) and the test and lint tools.
$(VENV)/.all: $(VENV)/.core pyproject.toml
	$(TORCH_PIP) pip $(BIN)/python -q -e '.[dev,cache,training]'
	touch $@

install: $(VENV)/.core
install-dev: $(VENV)/.all

vllm-env:
	bash deploy/local/vllm-env.sh

redis-server:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
	@redis-server --version

litellm-env:
	bash bench/litellm-env.sh

# The gateway's port: make demo DEMO_PORT=8081 when 8080 is taken.
DEMO_PORT ?= 8080

portkey-env:
	bash bench/portkey-env.sh

demo: install vllm-env
	$(BIN)/python -m deploy.local.demo --port $(DEMO_PORT)

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install-dev
	$(BIN)/mypy

test: install-dev vllm-env redis-server lint typecheck
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: install-dev
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not vllm"

bench-overhead: install-dev litellm-env portkey-env
	$(BIN)/python -m bench.overhead

bench-routing: install-dev
	$(BIN)/python -m bench.prefix_routing

bench-cache: install-dev redis-server
	$(BIN)/python -m bench.cache

# A local tracing UI (Arize Phoenix, own venv .venv-phoenix) on http://127.0.0.1:6006;
# then, in another terminal: DEMO_TRACING=true make demo
tracing-ui:
	bash deploy/tracing-ui.sh

check-dashboard: install
	$(BIN)/python deploy/check_dashboard.py

clean:
	rm -rf $(VENV) .venv-vllm .venv-litellm .venv-portkey .venv-phoenix .cache .mypy_cache .ruff_cache
