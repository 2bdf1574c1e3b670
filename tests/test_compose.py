"""docker-compose.yml for real: the images built here with no registry (tests/docker_engine.py),
then Debian's docker-compose brings up Redis with its replica and three sentinels (profile
"ha"), the API, the three pools, Flower and the dev model (profile "dev"), and the farm
serves, recovers (a pool killed, the Redis primary killed) and goes down through them.

The services run on the host network (an override file, with the ports each listens on), so
every request of the test stays on this machine's loopback: compose's own file, with the
override merged by ``docker-compose config`` and the host-port mappings taken out (Docker
refuses them beside the host network).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
import requests
import yaml

from prorl_farm.trainer import FarmClient
from tests.docker_engine import DEV_MODEL, FARM, REDIS, farm_images
from tests.farm import ROOT, free_port, own_processes, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not shutil.which("docker-compose"),
    reason="Debian's docker-compose is not installed (make test installs it)")]

SERVICES = ("redis", "api", "init", "run", "eval", "flower", "gym", "dev-model",
            "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3")
PROFILES = ("--profile", "dev", "--profile", "ha")
TOKEN = "compose-test-token"
# Pools' heartbeats: how long a restarting pool has to come back before the jobs waiting on
# its node's queue are moved (and, their requeues spent, failed). A killed pool's container,
# restarted on a loaded machine, has taken more than 30 s (the product's default) to beat:
# the test gives it 120 s. Only a failed recovery waits that long.
STALE_S = 120


class Compose:
    def __init__(self, engine, work: Path):
        self.engine = engine
        self.project = f"prorlc{os.getpid()}"
        self.ports = {name: free_port() for name in ("redis", "api", "flower", "gym",
                                                     "model", "replica", "s1", "s2", "s3")}
        self.env = {**engine.env, "PRORL_API_TOKEN": TOKEN,
                    "PRORL_FLOWER_BASIC_AUTH": "ops:compose-test",
                    "PRORL_REDIS_IMAGE": REDIS, "PRORL_HEARTBEAT_STALE_S": str(STALE_S),
                    "PRORL_RUN_CONCURRENCY": "16"}
        override = work / "host-network.yml"
        override.write_text(yaml.safe_dump(self._override()))
        merged = yaml.safe_load(self("-f", str(ROOT / "docker-compose.yml"), "-f",
                                     str(override), "config", project=False).stdout)
        for svc in merged["services"].values():
            svc.pop("ports", None)
        self.file = work / "compose-host.yml"
        self.file.write_text(yaml.safe_dump(merged))

    def _override(self) -> dict:
        p = self.ports
        # The farm on the Sentinel service of profile "ha" (redis, its replica, three
        # sentinels), here on loopback ports.
        redis_url = (f"redis+sentinel://127.0.0.1:{p['s1']},127.0.0.1:{p['s2']},"
                     f"127.0.0.1:{p['s3']}/prorl/0")

        def health(*test: str, every: str = "2s") -> dict:
            # (Each check is a process started in the container: a cost of the machine's.)
            return {"test": ["CMD", *test], "interval": every, "timeout": "15s",
                    "retries": 30, "start_period": "0s"}

        farm_env = {"PRORL_REDIS_URL": redis_url}
        services = {
            "redis": {"command": ["redis-server", "--port", str(p["redis"]), "--bind",
                                  "127.0.0.1", "--dir", "/data", "--appendonly", "yes",
                                  "--appendfsync", "always", "--save", "",
                                  "--hash-max-listpack-value", "1024"],
                      "healthcheck": health("redis-cli", "-p", str(p["redis"]), "ping")},
            "api": {"environment": {**farm_env, "PRORL_API_HOST": "127.0.0.1",
                                    "PRORL_API_PORT": str(p["api"])},
                    "healthcheck": health("curl", "-fsS",
                                          f"http://127.0.0.1:{p['api']}/healthz")},
            "redis-replica": {"command": [
                "redis-server", "--port", str(p["replica"]), "--bind", "127.0.0.1", "--dir",
                "/data", "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                "--hash-max-listpack-value", "1024", "--replicaof", "127.0.0.1",
                str(p["redis"]), "--repl-diskless-sync-delay", "0"],
                "healthcheck": health("redis-cli", "-p", str(p["replica"]), "ping",
                                      every="5s")},
            **{f"sentinel-{i}": {"environment": {"PRIMARY": f"127.0.0.1 {p['redis']}",
                                                 "SENTINEL_PORT": str(p[f"s{i}"])},
                                 "healthcheck": health("sh", "-c", f"redis-cli -p {p[f's{i}']} "
                                                       "sentinel get-master-addr-by-name "
                                                       "prorl | grep -q .", every="5s")}
               for i in (1, 2, 3)},
            "flower": {"environment": farm_env,
                       "command": ["celery", "-A", "prorl_farm.celery_app", "flower",
                                   f"--port={p['flower']}", "--address=127.0.0.1"],
                       "healthcheck": health("curl", "-fsS",
                                             f"http://127.0.0.1:{p['flower']}/healthcheck")},
            "gym": {"environment": farm_env,
                    "command": ["prorl-farm", "gym", "--host", "127.0.0.1", "--port",
                                str(p["gym"]), "--farm", f"http://127.0.0.1:{p['api']}"],
                    "healthcheck": health("curl", "-fsS",
                                          f"http://127.0.0.1:{p['gym']}/healthz")},
            "dev-model": {"command": ["sh", "-c", "prorl-farm tiny-model /models/tiny && exec "
                                      "prorl-farm serve-model --model /models/tiny --host "
                                      f"127.0.0.1 --port {p['model']}"],
                          "healthcheck": health("curl", "-fsS",
                                                f"http://127.0.0.1:{p['model']}/health")},
        }
        for stage in ("init", "run", "eval"):
            services[stage] = {"environment": farm_env,
                               "healthcheck": health("prorl-farm", "check-pool", stage)}
        for svc in services.values():
            svc["network_mode"] = "host"
        return {"services": services}

    def __call__(self, *args: str, project: bool = True, check: bool = True,
                 timeout: float = 600) -> subprocess.CompletedProcess:
        head = ["docker-compose"]
        if project:
            head += ["-p", self.project, "-f", str(self.file)]
        out = subprocess.run([*head, *args], env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(args)}: {out.stderr[-3000:]}")
        return out

    def container(self, service: str) -> str:
        [name] = self.engine.containers(f"label=com.docker.compose.project={self.project}",
                                        f"label=com.docker.compose.service={service}")
        return name

    def health(self) -> dict[str, str]:
        names = self.engine.containers(f"label=com.docker.compose.project={self.project}")
        if not names:
            return {}
        out = self.engine.run("inspect", "--format", '{{index .Config.Labels '
                              '"com.docker.compose.service"}} {{if .State.Health}}'
                              "{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}",
                              *names).stdout
        return dict(line.split() for line in out.splitlines())

    def healthy(self, services=SERVICES) -> bool:
        health = self.health()
        return all(health.get(s) == "healthy" for s in services)

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "40", check=False).stdout[-8000:]


@pytest.fixture
def compose(docker_engine, tmp_path_factory):
    docker_engine.build_times.update(farm_images(docker_engine,
                                                 tmp_path_factory.mktemp("docker-build")))
    for image in (FARM, DEV_MODEL, REDIS):
        docker_engine.run("image", "inspect", image)
    c = Compose(docker_engine, tmp_path_factory.mktemp("compose"))
    try:
        yield c
    finally:
        # Before the leak check of the test's end: a failed test leaves nothing running.
        c(*PROFILES, "down", "-v", "--remove-orphans", "-t", "10", check=False)


def _wait_healthy(c: Compose, timeout_s: float = 300) -> float:
    t = time.monotonic()
    try:
        wait_until(c.healthy, timeout_s, 0.5, "every service healthy")
    except Exception:
        raise AssertionError(f"not every service healthy: {c.health()}\n{c.logs()}"
                             ) from None
    return time.monotonic() - t


def test_compose_up_serves_recovers_and_goes_down(compose, docker_engine, tmp_path):
    c = compose
    figures = dict(docker_engine.build_times)
    t = time.monotonic()
    c(*PROFILES, "up", "-d")
    _wait_healthy(c)
    figures["time_to_healthy_s"] = time.monotonic() - t
    farm = FarmClient(f"http://127.0.0.1:{c.ports['api']}", token=TOKEN)
    assert farm.ready()
    # Flower is up behind its basic auth.
    flower = f"http://127.0.0.1:{c.ports['flower']}/api/workers"
    assert requests.get(flower, timeout=10).status_code == 401
    assert requests.get(flower, auth=("ops", "compose-test"), timeout=10).ok

    # The dev model as a backend; its tokenizer where the pools see it (the models volume).
    farm.register_backend(f"http://127.0.0.1:{c.ports['model']}", "vllm", "tiny",
                          "/models/tiny", capacity=16)
    [backend] = farm.backends()
    assert backend["healthy"], backend

    # A batch of each kind, through the API and the three pools' containers.
    synthetic = farm.submit("synthetic", [{"run_s": 0.2}], n=6)
    shell = farm.submit("shell", [{"commands": ["echo 6 > out.txt"],
                                   "check": "test \"$(cat out.txt)\" = 6"},
                                  {"commands": ["echo 5 > out.txt"],
                                   "check": "test \"$(cat out.txt)\" = 6"}], n=2)
    math = farm.submit("math", [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)}
                                for i in range(4)], n=2, deadline_s=240,
                       sampling={"max_tokens": 8, "temperature": 1.0, "max_turns": 2})
    ended = {}
    # A NeMo Gym row through the gym service's /run: a farm job, answered in Gym's shape.
    row = {"responses_create_params": {"input": "x"},
           "prorl": {"handler": "synthetic", "instance": {"reward": 0.5}}}
    gym = f"http://127.0.0.1:{c.ports['gym']}/run"
    assert requests.post(gym, json=row, timeout=30).status_code == 401  # it holds no key
    out = requests.post(gym, json=row, timeout=120,
                        headers={"Authorization": f"Bearer {TOKEN}"})
    assert out.status_code == 200 and out.json()["reward"] == 0.5, out.text
    assert farm.job(out.json()["prorl_job_id"])["state"] == "done"
    for sub in (synthetic, shell, math):
        jobs = list(farm.iter_results(sub["batch_id"], timeout_s=240))
        assert sorted(j["id"] for j in jobs) == sorted(sub["job_ids"])
        assert all(j["state"] == "done" for j in jobs), [j.get("failure") for j in jobs]
        ended[sub["batch_id"]] = jobs
    shell_rewards = sorted(farm.job(j["id"])["reward"] for j in ended[shell["batch_id"]])
    assert shell_rewards == [0.0, 0.0, 1.0, 1.0]  # the check ran, in a fresh sandbox
    for j in ended[math["batch_id"]]:
        t = farm.job(j["id"])["result"]
        assert t["turns"] and t["turns"][0]["backend"] == backend["id"]
        assert len(t["response_ids"]) == len(t["response_logprobs"])

    # A pool container killed mid-batch (its main process, SIGKILL from the host, as the
    # OOM killer would: `docker kill` counts as a stop by hand, which no policy restarts):
    # its jobs are taken back, and finish once the container is back by its restart policy.
    held = farm.submit("synthetic", [{"run_s": 6.0}], n=6)

    def active() -> int:
        jobs = (farm.job(j) for j in held["job_ids"])
        return sum((j["state"], j["phase"]) == ("run", "active") for j in jobs)

    wait_until(lambda: active() == 6, 60, 0.2, "the long jobs running")
    run_container = c.container("run")
    t = time.monotonic()
    pid = int(docker_engine.run("inspect", "--format", "{{.State.Pid}}",
                                run_container).stdout)
    os.kill(pid, signal.SIGKILL)
    jobs = list(farm.iter_results(held["batch_id"], timeout_s=STALE_S + 180))
    figures["requeue_after_kill_s"] = time.monotonic() - t
    assert all(j["state"] == "done" for j in jobs), ([j.get("failure") for j in jobs],
                                                     c.logs())
    assert all(farm.job(j["id"])["requeues"] >= 1 for j in jobs)
    assert docker_engine.run("inspect", "--format", "{{.RestartCount}}",
                             run_container).stdout.strip() != "0"
    wait_until(lambda: c.healthy(("run",)), 120, 0.5, "the run pool healthy again")

    # The Redis primary killed with a batch queued and running: the sentinels promote the
    # replica and the farm follows it; nothing of the batch, nor of what ended before, is
    # lost. Started again, the old primary rejoins as a replica.
    before = farm.batches()
    queued = farm.submit("synthetic", [{"run_s": 1.0}], n=24)
    t = time.monotonic()
    docker_engine.run("kill", c.container("redis"))
    jobs = list(farm.iter_results(queued["batch_id"], timeout_s=420))
    figures["batch_done_after_primary_killed_s"] = time.monotonic() - t
    primary = redis.Redis(port=c.ports["s1"], decode_responses=True
                          ).sentinel_get_master_addr_by_name("prorl")
    assert int(primary[1]) == c.ports["replica"], primary
    docker_engine.run("start", c.container("redis"))
    assert sorted(j["id"] for j in jobs) == sorted(queued["job_ids"])
    assert all(j["state"] == "done" for j in jobs), [j.get("failure") for j in jobs]
    assert {b["batch_id"] for b in before} <= {b["batch_id"] for b in farm.batches()}
    for batch_id, jobs in ended.items():
        assert farm.batch(batch_id)["counts"].get("done") == len(jobs)
    _wait_healthy(c, 300)

    # down: nothing of the project is left (containers, networks, volumes, sandboxes).
    c(*PROFILES, "down", "-v", "-t", "30")
    label = f"label=com.docker.compose.project={c.project}"
    assert docker_engine.containers(label) == []
    assert docker_engine.run("volume", "ls", "-q", "--filter", label).stdout.split() == []
    assert docker_engine.run("network", "ls", "-q", "--filter", label).stdout.split() == []
    leftovers = [line.split()[0] for line in
                 own_processes("prorl-farm worker|bwrap --unshare-user")]
    assert not [pid for pid in leftovers if _in_container(pid)], leftovers
    print("compose figures: " + json.dumps({k: round(v, 1) for k, v in figures.items()}))
    (ROOT / ".prorl").mkdir(exist_ok=True)
    (ROOT / ".prorl" / "compose-figures.json").write_text(json.dumps(figures, indent=1))


def _in_container(pid: str) -> bool:
    """Whether a host process belongs to a Docker container (its cgroup says so)."""
    try:
        return "docker" in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
