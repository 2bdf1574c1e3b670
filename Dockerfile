# The farm's image: the API, the pools and Flower run from it (see docker-compose.yml).
# Sandboxes are bubblewrap inside the container; the pools' services need user namespaces
# (docker-compose.yml gives them seccomp/apparmor "unconfined").
FROM python:3.11-slim-bookworm AS farm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PRORL_API_HOST=0.0.0.0 PRORL_HOME=/var/lib/prorl
# bubblewrap: sandboxes; git and the system Python's pytest: swe repositories and their
# tests inside sandboxes; curl: health checks.
RUN apt-get update \
 && apt-get install -y -q --no-install-recommends bubblewrap git python3 python3-pytest curl \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/prorl-farm
COPY requirements.txt pyproject.toml README.md ./
RUN pip install -r requirements.txt
COPY prorl_farm ./prorl_farm
COPY api ./api
COPY workers ./workers
RUN pip install --no-deps . && mkdir -p /var/lib/prorl
EXPOSE 8000 5555
CMD ["prorl-farm", "api"]

# The CPU dev model server (tests and demos): the farm plus torch.
FROM farm AS dev-model
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.3"
EXPOSE 8100
CMD ["prorl-farm", "serve-model", "--model", "/models/tiny", "--host", "0.0.0.0", "--port", "8100"]
