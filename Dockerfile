# The farm's image: the API, the pools and Flower run from it (see docker-compose.yml).
# Sandboxes are bubblewrap inside the container; the pools' services need user namespaces
# (docker-compose.yml gives them seccomp/apparmor "unconfined").
#
# BASE: any Debian 12 (bookworm) image with Python 3.11 and its venv module. The default is
# the public python image; with no registry, deploy/base-image.sh makes one from Debian
# packages:  docker build --build-arg BASE=prorl-base:bookworm -t prorl-farm:latest .
# PIP_OPTS: options for every pip install, e.g. "--no-index --find-links http://host/wheels"
# to install from a wheelhouse of your own (tests/test_compose.py builds with one).
ARG BASE=python:3.11-slim-bookworm
# The layers are ordered by how often they change, so that a rebuild after a change to the
# farm's code reuses the packages: system packages, then the Python requirements (and torch
# for the dev model), then the farm's source last.
FROM ${BASE} AS deps
ARG PIP_OPTS=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PRORL_API_HOST=0.0.0.0 PRORL_HOME=/var/lib/prorl \
    PATH=/opt/venv/bin:$PATH
# bubblewrap: sandboxes; git and the system Python's pytest: swe repositories and their
# tests inside sandboxes; curl: health checks. (A base that has them all skips apt.)
RUN dpkg -s bubblewrap git python3 python3-pytest python3-venv curl >/dev/null 2>&1 \
 || { apt-get update \
      && apt-get install -y -q --no-install-recommends bubblewrap git python3 python3-pytest \
         python3-venv curl \
      && rm -rf /var/lib/apt/lists/*; }
# The farm's own environment (Debian's Python refuses system-wide pip installs).
RUN python3 -m venv /opt/venv
WORKDIR /opt/prorl-farm
COPY requirements.txt ./
RUN pip install $PIP_OPTS -r requirements.txt && mkdir -p /var/lib/prorl

FROM deps AS farm
ARG PIP_OPTS=""
COPY pyproject.toml README.md ./
COPY prorl_farm ./prorl_farm
COPY api ./api
COPY workers ./workers
RUN pip install $PIP_OPTS --no-deps .
EXPOSE 8000 5555
CMD ["prorl-farm", "api"]

# The CPU dev model server (tests and demos): the farm plus torch, torch's layer before the
# farm's source.
# TORCH_INDEX: where the CPU build of torch comes from (PyPI's default build is CUDA's).
FROM deps AS dev-model
ARG PIP_OPTS=""
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch>=2.3"
RUN pip install --index-url "$TORCH_INDEX" $PIP_OPTS "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY prorl_farm ./prorl_farm
COPY api ./api
COPY workers ./workers
RUN pip install $PIP_OPTS --no-deps .
EXPOSE 8100
CMD ["prorl-farm", "serve-model", "--model", "/models/tiny", "--host", "0.0.0.0", "--port", "8100"]
