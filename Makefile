# ComputeDomain service. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY := .venv/bin/python
STAMP := .venv/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
PYTEST_ARGS ?=
# e.g. BENCH_ARGS=--smoke (seconds, one round), --out DIR (report directory), --cluster DIR
BENCH_ARGS ?=

.PHONY: help install testbin image cluster-up cluster-down demo test test-unit test-cluster test-gpu lint format typecheck crds manifests bench bench-controller bench-plugin bench-system bench-fleet bench-channels bench-realnode

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[test,dev]'
	@rm -f .venv/.installed-*; touch $(STAMP)

install: $(STAMP) ## create .venv with the pinned Python dependencies (idempotent)

testbin: ## build the control plane, kwok, helm and the real nodes' kubelet, containerd, runc (cached by version)
	@testbin/build.sh >/dev/null

image: install testbin ## the project's image as an OCI archive, without Docker (cached by content; prints size)
	@$(PY) -m tests.testbed.image

# The control plane's binaries build while the virtual environment installs (a first run waits for both).
cluster-up: ## start the local control plane (builds only its binaries); kubeconfig at .cluster/kubeconfig
	@setsid -w testbin/build.sh control-plane >/dev/null & build=$$!; trap 'kill -- -$$build 2>/dev/null' INT TERM; \
	  if ! $(MAKE) --no-print-directory install; then kill -- -$$build 2>/dev/null; exit 1; fi; wait $$build
	@$(PY) -m tests.testbed.cluster up

cluster-down: install ## stop the local control plane
	@$(PY) -m tests.testbed.cluster down

demo: cluster-up ## run the demo on the local cluster (REAL=1: on two real nodes, kubelet + containerd)
	@$(PY) -m $(if $(filter 1 yes true,$(REAL)),tests.testbed.realnode.demo,tests.testbed.demo)

test: install testbin image ## everything: lint, types, unit and cluster tests (starts a cluster for the run)
	@$(MAKE) --no-print-directory lint typecheck
	@$(PY) -m pytest $(PYTEST_ARGS)

test-unit: install ## unit tests only (no cluster)
	@$(PY) -m pytest -m 'not cluster and not gpu' $(PYTEST_ARGS)

test-cluster: install testbin image ## cluster tests only (the real-node ones run the image)
	@$(PY) -m pytest -m cluster $(PYTEST_ARGS)

test-gpu: install ## hardware lane: NVML and /proc tests on a real NVIDIA GPU (skip cleanly without one)
	@$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lint: install ## ruff lint + format check, import boundaries
	@.venv/bin/ruff check .
	@.venv/bin/ruff format --check .
	@.venv/bin/lint-imports

format: install ## apply ruff formatting and fixes
	@.venv/bin/ruff format .
	@.venv/bin/ruff check --fix .

typecheck: install ## mypy --strict on the packages
	@.venv/bin/mypy

crds: install ## regenerate manifests/crds from the pydantic models (then the chart and base, see manifests)
	@$(PY) -m computedomain.api.crdgen manifests/crds
	@$(MAKE) --no-print-directory manifests

manifests: install testbin ## regenerate manifests/base and the chart's CRDs from the chart
	@$(PY) manifests/generate.py

bench: install testbin ## all benchmarks: medians, p99, spread over rounds; .bench/report.md (plots) + summary.txt
	@$(PY) -m tests.bench $(BENCH_ARGS)

bench-controller: install testbin ## controller: create burst vs the API floor, Ready latency, 1,000 domains (SPEC 9)
	@$(PY) -m tests.bench $(BENCH_ARGS) controller

bench-plugin: install testbin ## node agent Prepare latency, in-process, through the API, hostManaged (SPEC 9)
	@$(PY) -m tests.bench $(BENCH_ARGS) plugin

bench-system: install testbin ## a 72-node domain on the simulated cluster, end to end (SPEC 9)
	@$(PY) -m tests.bench $(BENCH_ARGS) system

bench-fleet: install testbin ## 1,000 kwok nodes, 200 domains: controller convergence, requests, memory
	@$(PY) -m tests.bench $(BENCH_ARGS) fleet

bench-channels: install testbin ## channel isolation: 200 domains assigned at once, the extra time per Prepare
	@$(PY) -m tests.bench $(BENCH_ARGS) channels

bench-realnode: install testbin image ## real nodes: pod create -> Running with and without a claim, Prepare, memory, start-up
	@$(PY) -m tests.bench $(BENCH_ARGS) realnode
