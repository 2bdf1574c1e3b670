"""slurm/ on a real Slurm: a single-node cluster from Debian packages runs the head and worker
nodes as batch jobs; a batch goes through; an array task adds a node; scancel of one worker
node mid-batch hands its jobs to the other, failing none; scancel of everything leaves
nothing running."""

from __future__ import annotations

import os
import sys

import psutil
import pytest
import requests

from prorl_farm.trainer import FarmClient
from prorl_farm.trainer.farm import FarmUnauthorized
from tests.farm import ROOT, free_port, wait_until
from tests.slurm_cluster import SlurmCluster, install

# a single-node Slurm of the machine's own (its daemons, its configuration): alone
pytestmark = [pytest.mark.slow, pytest.mark.serial]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = install()
    if why:
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
    except Exception as e:
        c.stop()
        raise RuntimeError(f"single-node Slurm did not start: {e}") from e
    yield c
    c.stop()


def _head_env(shared) -> dict:
    env = {}
    for line in (shared / "head.env").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    return env


def _farm_processes(shared) -> list[str]:
    """Processes started for this farm: anything whose command line names its shared
    directory, and its pools, API and Gym server (their environment names it)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            farmish = ("prorl_farm.cli worker" in cmd or "prorl_farm.cli gym" in cmd or
                       "prorl_farm.celery_app" in cmd or "api.wsgi:app" in cmd)
            # Another farm's pools on this machine (a test beside this one) are not ours.
            if str(shared) in cmd or (farmish and
                                      p.environ().get("PRORL_SHARED") == str(shared)):
                out.append(f"{p.pid} {cmd[:120]}")
        except psutil.Error:
            pass
    return out


def _submit_env(shared, **settings) -> dict:
    """The submitter's environment: the scripts' settings, fresh ports, no PRORL_* of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    env.update(PRORL_SHARED=str(shared), PRORL_FARM_DIR=str(ROOT), PRORL_PYTHON=sys.executable,
               PRORL_HEAD_HOST="127.0.0.1", PRORL_REDIS_PORT=str(free_port()),
               PRORL_API_PORT=str(free_port()), PRORL_FLOWER_PORT=str(free_port()),
               PRORL_GYM_PORT=str(free_port()),
               PRORL_LOG_LEVEL="WARNING", **{f"PRORL_{k.upper()}": v for k, v in
                                              settings.items()})
    return env


def test_slurm_head_workers_scale_out_scancel_and_nothing_left(cluster, tmp_path):
    shared = tmp_path / "shared"
    env = _submit_env(shared, heartbeat_stale_s="60", run_concurrency="4")
    sbatch_args = ["--chdir", str(tmp_path), "--cpus-per-task=1", "--mem=100M"]
    head = cluster.sbatch(ROOT / "slurm" / "head.sbatch", *sbatch_args, env=env)
    workers = [cluster.sbatch(ROOT / "slurm" / "workers.sbatch", *sbatch_args, env=env)]
    try:
        wait_until(lambda: (shared / "head.env").exists(), 90, 0.3,
                   lambda: f"head.env ({cluster.state(head)})\n{cluster.log_tail()}")
        head_env = _head_env(shared)
        assert (shared / "head.env").stat().st_mode & 0o077 == 0  # credentials: owner only
        farm = FarmClient(head_env["PRORL_URL"], token=head_env["PRORL_API_TOKEN"])
        wait_until(farm.ready, 90, 0.3, "the first worker node's pools")
        with pytest.raises(FarmUnauthorized):  # off loopback every read needs the key
            FarmClient(head_env["PRORL_URL"], token="").backends()
        assert farm.backends() == []
        # The head's NeMo Gym agent server, published beside the API.
        assert requests.get(head_env["PRORL_GYM_URL"] + "/healthz", timeout=10).json() == \
            {"status": "ok"}
        sub = farm.submit("synthetic", [{"run_s": 0.05}], n=8)
        jobs = list(farm.iter_results(sub["batch_id"], timeout_s=60))
        assert [j["state"] for j in jobs] == ["done"] * 8
        first_node = jobs[0]["node"]

        # Scale out: an array task of another submission is a second node.
        workers.append(cluster.sbatch(ROOT / "slurm" / "workers.sbatch", "--array=1",
                                      *sbatch_args, env=env))

        def nodes() -> set[str]:
            return {p["node"] for p in farm._call("GET", "/v1/overview")["pools"]}

        wait_until(lambda: len(nodes()) == 2, 90, 0.3, "a second node")
        second_node = (nodes() - {first_node}).pop()

        # A batch both nodes work on; the first node is cancelled while it runs jobs.
        sub = farm.submit("synthetic", [{"run_s": 1.5}], n=24)

        def busy_nodes() -> set[str]:
            return {j["node"] for j in map(farm.job, sub["job_ids"])
                    if j["state"] == "run" and j["phase"] == "active"}

        wait_until(lambda: busy_nodes() == {first_node, second_node}, 60, 0.2,
                   "both nodes running jobs")
        cluster.run("scancel", workers[0])
        jobs = list(farm.iter_results(sub["batch_id"], timeout_s=120))
        assert [j["state"] for j in jobs] == ["done"] * 24, [j["failure"] for j in jobs]
        moved = [j for j in jobs if j["attempts"]]
        assert moved, "the cancelled node held no job"
        assert all(first_node in j["attempts"][-1]["reason"] and j["node"] == second_node
                   for j in moved), (first_node, second_node,
                                     [(j["node"], j["attempts"]) for j in moved])
        assert all(j["requeues"] == 0 for j in jobs)
        wait_until(lambda: not cluster.state(workers[0]), 60, 0.3, "the cancelled node gone")
        # It said goodbye: gone well within the stale time (60 s), once its pools have ended
        # (Slurm may report the job gone while they still finish their shutdown).
        wait_until(lambda: nodes() == {second_node}, 15, 0.2, "the cancelled node's goodbye")
    finally:
        cluster.run("scancel", head, *workers, check=False)
        wait_until(lambda: not any(cluster.state(j) for j in [head, *workers]), 90, 0.5,
                   "every job to leave the queue")
    # Nothing left running: no pool, API, Flower or Redis of this farm, no sandbox.
    wait_until(lambda: not _farm_processes(shared), 30, 0.5,
               lambda: f"leftover processes: {_farm_processes(shared)}")
    comp = (cluster.root / "log" / "jobcomp.txt").read_text()
    for job_id in [head, *workers]:
        assert f"JobId={job_id.split('_')[0]}" in comp
    for node in (first_node, second_node):  # each node's sandbox directory went with it
        assert not os.path.exists(f"/tmp/prs-{node}")


def test_slurm_one_allocation_farm(cluster, tmp_path):
    """farm.sbatch: head and a worker node as srun steps of one job; the node runs two RUN
    pool processes (PRORL_RUN_PROCESSES), both serving."""
    shared = tmp_path / "shared"
    env = _submit_env(shared, run_processes="2")
    job = cluster.sbatch(ROOT / "slurm" / "farm.sbatch", "--nodes=1", "--chdir", str(tmp_path),
                         "--cpus-per-task=1", "--mem=100M", env=env)
    try:
        wait_until(lambda: (shared / "head.env").exists(), 90, 0.3,
                   lambda: f"head.env ({cluster.state(job)})\n{cluster.log_tail()}")
        head_env = _head_env(shared)
        farm = FarmClient(head_env["PRORL_URL"], token=head_env["PRORL_API_TOKEN"])
        wait_until(farm.ready, 90, 0.3, "the pools")
        runs = [p for p in _farm_processes(shared) if p.endswith("prorl_farm.cli worker run")]
        assert len(runs) == 2, _farm_processes(shared)
        sub = farm.submit("synthetic", [{"run_s": 0.05}, {"fail_stage": "eval"}], n=3)
        jobs = list(farm.iter_results(sub["batch_id"], timeout_s=60))
        assert sorted(j["state"] for j in jobs) == ["done"] * 3 + ["failed"] * 3
        steps = cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%i")
        assert len(steps.split()) >= 2  # the head's step and the workers' step (and batch)
    finally:
        cluster.run("scancel", job, check=False)
        wait_until(lambda: not cluster.state(job), 90, 0.5, "the job to leave the queue")
    wait_until(lambda: not _farm_processes(shared), 30, 0.5,
               lambda: f"leftover processes: {_farm_processes(shared)}")
