"""docker-compose.yml and the Dockerfile, checked without a Docker engine: the file parses,
every service runs a real entry point of the project, every PRORL_* name is a setting."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import yaml

from prorl_farm import keys
from prorl_farm.cli import build_parser
from prorl_farm.config import env_names
from tests.farm import ROOT

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
SERVICES = {"redis", "api", "init", "run", "eval", "flower", "gym", "dev-model",
            "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"}
# Redis's own programs (on the Redis image), not the project's.
REDIS_SERVICES = {"redis", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return set(action.choices)


def _check_command(argv: list[str]) -> None:
    """A command the image can run: `prorl-farm <subcommand>` (parsed by the real parser),
    `celery -A prorl_farm.celery_app ...`, or a shell line of those."""
    if argv[:2] == ["sh", "-c"]:
        for part in argv[2].split("&&"):
            words = shlex.split(part.replace("exec ", "", 1))
            _check_command(words)
        return
    if argv[0] == "prorl-farm":
        assert argv[1] in _subcommands(), argv
        args = build_parser().parse_args(argv[1:])  # exits (fails the test) if invalid
        assert args.func
    elif argv[0] == "celery":
        app = argv[argv.index("-A") + 1]
        out = subprocess.run([sys.executable, "-c", f"import {app}; print({app}.app.main)"],
                             cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == "prorl_farm", out.stderr
    elif argv[0] in ("redis-server", "redis-cli", "curl", "CMD"):
        pass
    else:
        raise AssertionError(f"not an entry point of the project: {argv}")


def test_compose_has_every_part_with_health_checks(compose):
    services = compose["services"]
    assert set(services) == SERVICES
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no health check"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        _check_command(test[1:])
    redis = services["redis"]["command"]
    assert redis[redis.index("--appendonly") + 1] == "yes"
    assert redis[redis.index("--hash-max-listpack-value") + 1] == \
        str(keys.HASH_MAX_LISTPACK_VALUE)
    assert f"hash-max-listpack-value {keys.HASH_MAX_LISTPACK_VALUE}\n" in \
        (ROOT / "slurm" / "head.sh").read_text()
    for name in ("api", "init", "run", "eval"):  # one trajectory store for the API and pools
        assert "trajectories:/var/lib/prorl/trajectories" in services[name]["volumes"]
    assert services["dev-model"]["profiles"] == ["dev"]
    for name in REDIS_SERVICES - {"redis"}:  # a replica and three sentinels on demand
        assert services[name]["profiles"] == ["ha"]
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1:][:2] == ["redis", "6379"]
    for stage in ("init", "run", "eval"):
        assert services[stage]["command"] == ["prorl-farm", "worker", "--mount-proc", stage]
        assert "sandboxes:/var/lib/prorl/sandboxes" in services[stage]["volumes"]
    for stage in ("run", "eval"):  # they use the sandboxes INIT starts
        assert services[stage]["pid"] == "service:init"


def test_every_service_command_is_a_real_entry_point(compose):
    for name, svc in compose["services"].items():
        if name in REDIS_SERVICES:
            continue
        _check_command(svc["command"])


def test_every_prorl_name_is_a_setting(compose):
    known = env_names()
    text = COMPOSE.read_text()
    used = set(re.findall(r"\bPRORL_[A-Z_]+", text))
    # Names read by compose itself: host ports, images.
    compose_only = {"PRORL_API_PUBLISH", "PRORL_FLOWER_PUBLISH", "PRORL_GYM_PUBLISH",
                    "PRORL_BASE_IMAGE", "PRORL_REDIS_IMAGE"}
    assert used - known - compose_only == set(), "not settings: " + str(used - known)
    assert used & compose_only <= {n for n in compose_only if f"${{{n}:-" in text}
    for svc in compose["services"].values():
        for key in (svc.get("environment") or {}):
            assert not key.startswith("PRORL_") or key in known, key
    # And the settings do reject a wrong value of one of them (they are really read).
    from prorl_farm.config import load_settings
    from prorl_farm.errors import ConfigError

    with pytest.raises(ConfigError, match="PRORL_RUN_CONCURRENCY"):
        load_settings({"PRORL_RUN_CONCURRENCY": "lots"})


def test_dockerfile_copies_what_exists_and_runs_entry_points():
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)", text, re.M)
    assert stages == ["deps", "farm", "dev-model"]  # the packages, then the farm, the model
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    for cmd in re.findall(r"^CMD (\[.+\])$", text, re.M):
        _check_command(yaml.safe_load(cmd))
    for req in ("requirements.txt", "pyproject.toml"):
        assert req in text
    compose = yaml.safe_load(COMPOSE.read_text())
    targets = {svc["build"]["target"] for svc in compose["services"].values() if "build" in svc}
    assert targets <= set(stages)
