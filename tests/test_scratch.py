"""Scratch on disk, the node's memory flat: a ``swe`` instance whose test writes a 1 GiB log
file into its ``/tmp`` is graded (reference mode, the real pools as root, the grader's
sandbox and its jail) with that test passing, while the node's shared memory (``Shmem``,
what every tmpfs holds) stays within 256 MiB of where it was: the jail's ``/tmp`` is a
directory on disk in the grader's own ``/tmp``, itself on disk beside its workspace. With
the jail's ``/tmp`` in memory, as it was, the same write grew ``Shmem`` by the whole 1 GiB
(or failed the test where the tmpfs was smaller).

Serial: ``Shmem`` is the whole node's, and the suite's other workers start sandboxes too."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from tests.conftest import make_pools
from tests.farm import farm_env, needs_bwrap_and_git, run_batch, shmem_kb
from tests.test_swe import build_repos

pytestmark = [*needs_bwrap_and_git(), pytest.mark.serial]

LOG_TEST = '''import os
import tempfile


def test_log():
    path = os.path.join(tempfile.gettempdir(), "run.log")
    chunk = b"x" * (1 << 20)
    with open(path, "wb") as f:
        for _ in range(1024):
            f.write(chunk)
    assert os.path.getsize(path) == 1 << 30
'''


def _new_file_diff(path: str, text: str) -> str:
    lines = text.splitlines()
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n"
            f"+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n"
            + "".join(f"+{line}\n" for line in lines))


def test_a_1_gib_log_in_a_graders_tmp_leaves_shared_memory_flat(redis_server, r, tmp_path):
    from api import create_app
    from prorl_farm.config import load_settings

    repos = Path(tempfile.mkdtemp(prefix="prs-scratch-repos-"))
    os.chmod(repos, 0o755)
    instance = build_repos(repos)[0]
    instance = {**instance, "test_timeout_s": 120,
                "test_patch": instance["test_patch"] + _new_file_diff("tests/test_log.py",
                                                                      LOG_TEST),
                "FAIL_TO_PASS": [*instance["FAIL_TO_PASS"], "tests/test_log.py::test_log"]}
    settings = dict(sandbox_mount_roots=str(repos), node="scratchnode",
                    sandbox_dir=f"/tmp/prs-scratch-{os.getpid()}")
    (tmp_path / "pools").mkdir()
    pools = make_pools(redis_server, tmp_path / "pools", **settings)
    pools.start()
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], shmem_kb())

    try:
        client = create_app(load_settings(farm_env(redis_server.url, **settings))).test_client()
        before = shmem_kb()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        (job,) = run_batch(client, {"handler": "swe", "instances": [instance],
                                    "mode": "reference", "deadline_s": 300}, 300)
        stop.set()
        watcher.join()
        ev = job["result"]["eval"] if job.get("result") else job
        assert job["state"] == "done" and job["reward"] == 1.0, ev
        assert ev["tests"]["FAIL_TO_PASS"]["tests/test_log.py::test_log"] == "passed", ev
        grew_mb = (peak[0] - before) / 1024
        assert grew_mb < 256, f"the node's shared memory grew by {grew_mb:.0f} MiB"
    finally:
        stop.set()
        pools.stop()
        shutil.rmtree(repos, ignore_errors=True)
        shutil.rmtree(settings["sandbox_dir"], ignore_errors=True)
