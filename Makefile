# make run   : set up, build the tiny model, start Redis + tritonserver (detached), send one request
# make test  : set up, build the tiny model, run the whole test suite (starts its own stack on free ports)
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PY        := .venv/bin/python
RUN_DIR   ?= .run/main
MODEL_DIR ?= models/tiny-llama
PRESET    ?= tiny
LAUNCH_ARGS ?=
ENV       := . .tools/env.sh &&

.PHONY: help setup model run stop test lint bench-coldstart bench-warmup bench-compile bench-cache bench-scheduler clean distclean

help:
	@echo "make run | test | setup | model | stop | lint | bench-coldstart | bench-warmup | bench-compile | bench-cache | bench-scheduler | clean | distclean"

setup:
	bash scripts/setup.sh

model: setup
	$(PY) -m engine.build_model --preset $(PRESET) --out $(MODEL_DIR)

run: setup model
	$(PY) -m deploy.launch --run-dir $(RUN_DIR) --model-dir $(MODEL_DIR) $(LAUNCH_ARGS)
	@port=$$($(PY) -c "import json;print(json.load(open('$(RUN_DIR)/stack.json'))['grpc_port'])"); \
	echo "[run] python -m client generate --url localhost:$$port \"Once upon a time\""; \
	$(PY) -m client generate --url localhost:$$port "Once upon a time" \
	  || { echo "[run] the request failed; logs in $(RUN_DIR)/; server still running; stop it with: make stop"; exit 1; }
	@echo "server still running; stop it with: make stop"

stop:
	@if [ -x $(PY) ]; then $(PY) -m deploy.stop --run-dir $(RUN_DIR); else echo "no .venv: nothing to stop"; fi

test: setup model
	$(ENV) $(PY) -m pytest -q --durations=30 tests

lint: setup
	$(PY) -m ruff check .

bench-coldstart: setup model
	$(ENV) $(PY) -m bench.coldstart --starts 3 --idle-s 1

bench-warmup: setup model
	$(ENV) $(PY) -m bench.warmup
	$(ENV) $(PY) -m bench.l3_prefetch

bench-compile: setup model
	$(ENV) $(PY) -m bench.compile_cache

bench-cache: setup model
	$(ENV) $(PY) -m bench.prefix_cache
	$(ENV) HF_HUB_OFFLINE=1 $(PY) -m bench.semantic_cache
	$(ENV) $(PY) -m bench.replica_prefill
	$(ENV) $(PY) -m bench.store_cost
	$(ENV) $(PY) -m bench.tenant_quota
	$(ENV) $(PY) -m bench.tenant_quota --cache exact
	$(ENV) HF_HUB_OFFLINE=1 $(PY) -m bench.lookup_offload

bench-scheduler: setup model
	$(ENV) $(PY) -m bench.scheduler

clean: stop
	rm -rf .run models .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -not -path './.venv/*' -not -path './.tools/*' -prune -exec rm -rf {} +

distclean: clean
	rm -rf .venv .tools
