"""SandboxManager: a node's sandboxes — slots (loopback IPs), the node cap, start and
stop on every way a job ends, and the janitor for what is left over."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import stat
import time
import uuid
from pathlib import Path

import redis

from prorl_farm import keys
from prorl_farm.errors import JobAborted, StageTimeout
from prorl_farm.lua import Scripts
from prorl_farm.sandbox import cgroups
from prorl_farm.sandbox.abstract import (
    Sandbox,
    SandboxError,
    SandboxSpec,
    chown_tree,
    disk_scratch,
    gateway_dir,
    processes_of,
)
from prorl_farm.sandbox.interpreter import sandbox_python, usable_by
from prorl_farm.sandbox.runtimes import GATEWAY_RUNTIMES, RuntimeOptions, make_runtime
from prorl_farm.sandbox.runtimes.bwrap import SYSTEM
from prorl_farm.states import TERMINAL_STATES, JobState
from prorl_farm.toolserver.protocol import INSIDE_FARM, INSIDE_HARNESSES, INSIDE_WORKSPACE

log = logging.getLogger(__name__)

# Per node (keys.sandbox_slots): slot -> sandbox id; a slot gives a sandbox its own loopback
# IP. Per node (keys.sandbox_records): sandbox id -> JSON record (the Sandbox, its job, the
# job's requeue count). Slots are taken and given back by lua/sandbox_alloc.lua and
# lua/sandbox_free.lua.



def slot_ip(slot: int) -> str:
    """127.16.0.2 upwards; never .0, .1 or .255 in the last octet."""
    return f"127.{16 + slot // 62_500}.{(slot // 250) % 250}.{slot % 250 + 2}"


# Inside paths an extra read-only bind may not take (the sandbox's own system and files).
RESERVED_INSIDE = (*SYSTEM, "/proc", "/dev", "/etc", "/run", "/tmp", "/var/tmp", INSIDE_FARM,
                   INSIDE_WORKSPACE, INSIDE_HARNESSES)


def resolve_user(value: str) -> tuple[int, int] | None:
    """PRORL_SANDBOX_USER: ``auto`` (nobody when the farm runs as root, else the farm's own
    uid: None), a user name, or ``uid[:gid]``. Root is refused."""
    import pwd

    if value in ("", "auto"):
        if os.geteuid() != 0:
            return None
        value = "nobody"
    if value.replace(":", "").isdigit():
        uid, _, gid = value.partition(":")
        ids = (int(uid), int(gid or uid))
    else:
        try:
            entry = pwd.getpwnam(value)
        except KeyError:
            raise SandboxError(f"PRORL_SANDBOX_USER={value!r}: no such user") from None
        ids = (entry.pw_uid, entry.pw_gid)
    if ids[0] == 0:
        raise SandboxError("PRORL_SANDBOX_USER: sandboxes never run as root")
    if os.geteuid() != 0:
        if ids[0] != os.geteuid():
            raise SandboxError(f"PRORL_SANDBOX_USER={value!r}: only a root farm can run "
                               "sandboxes as another user")
        return None
    return ids


def _reaches_farm(run_as: tuple[int, int], python: str) -> bool:
    """Whether a sandbox running as ``run_as`` can have the farm's interpreter and packages
    bound in (bwrap, run as that user, must reach every source)."""
    try:
        binds = sandbox_python(run_as, python).binds
    except SandboxError:
        return False
    return all(usable_by(host, *run_as) for host, _ in binds)


def parse_paths(value: str) -> dict[str, str]:
    """``host[:inside],...`` -> {inside: host} (inside defaults to the host path)."""
    out = {}
    for item in filter(None, (x.strip() for x in value.split(","))):
        host, _, inside = item.partition(":")
        out[inside or host] = host
    return out


def under_mount_roots(host: str, roots: list[str], what: str = "read-only path") -> str:
    """The real path of ``host``, which an instance named (instances are untrusted input):
    it must exist and lie under one of the operator's mount roots."""
    real = os.path.realpath(host)
    real_roots = [os.path.realpath(r) for r in roots]
    if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in real_roots):
        raise SandboxError(f"{what} {host!r} is not under the operator's mount roots "
                           "(PRORL_SANDBOX_MOUNT_ROOTS)")
    if not os.path.exists(real):
        raise SandboxError(f"{what} {host!r} does not exist")
    return real


def check_ro_paths(ro_paths: dict[str, str], roots: list[str]) -> dict[str, str]:
    """Extra read-only binds asked for by a handler or an instance: each host path must lie
    under one of the operator's mount roots, each inside path outside the sandbox's own."""
    out = {}
    for inside, host in ro_paths.items():
        inside_n = os.path.normpath(inside)
        if not inside_n.startswith("/") or inside_n == "/" or any(
                inside_n == r or inside_n.startswith(r + "/") for r in RESERVED_INSIDE):
            raise SandboxError(f"read-only path {inside!r}: not a place a sandbox may mount")
        out[inside_n] = under_mount_roots(host, roots)
    return out


# What a warm sandbox's record names as its job until a job adopts it
# (prorl_farm/worker/warm.py).
WARM_PREFIX = "warm-"
# And a warm grader's, for as long as its pool renews its lease (sandbox/warm_graders.py).
GRADER_PREFIX = "grader-"


class SandboxManager:
    def __init__(self, r: redis.Redis, node: str, runtime: str = "auto",
                 root: str = "/tmp/prorl-sandboxes", max_sandboxes: int = 64,
                 user: str = "auto", python: str = "", ro_paths: str = "",
                 mount_roots: str = "", allow_network: bool = True, image: str = "",
                 trusted_roots: tuple[str, ...] = (), scratch_mb: int | None = None,
                 workspace_mb: int | None = None):
        self.r = r
        # The size of every memory-backed scratch directory of this node's sandboxes.
        self.scratch_bytes = scratch_mb << 20 if scratch_mb else None
        # And of their workspaces, each as a whole (the tool server holds it to this).
        self.workspace_bytes = workspace_mb << 20 if workspace_mb else None
        self.allow_network = allow_network
        self.node = node
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        self.run_as = resolve_user(user)
        if self.run_as is not None and user in ("", "auto") and not _reaches_farm(self.run_as,
                                                                                python):
            # A root farm installed where nobody cannot read it (under /root, in a private
            # directory): bwrap, run as that user, could not bind the farm's files in.
            log.warning("sandbox user uid %d cannot reach the farm's installation; sandboxes "
                        "run as the farm's own uid (still uid 1000 without capabilities "
                        "inside). Install the farm where that user can read it, or set "
                        "PRORL_SANDBOX_USER", self.run_as[0])
            self.run_as = None
        self.mount_roots = [p for p in mount_roots.split(",") if p.strip()]
        # Where the farm itself keeps what handlers bind (SWE environments): trusted, as
        # the mount roots are, but no instance names a path under them.
        self.trusted_roots = [p for p in trusted_roots if p]
        self.runtime = make_runtime(runtime, RuntimeOptions(self.root, self.run_as, python,
                                                            parse_paths(ro_paths), image))
        self.max_sandboxes = max_sandboxes
        self.slots_key = keys.sandbox_slots(node)
        self.records_key = keys.sandbox_records(node)
        self.lua = Scripts(r)
        # Jobs this process started a sandbox for (what stop_for_job may have to stop, with
        # the jobs whose claim said they have sandboxes: see JobContext.sandboxed).
        self._started_for: set[str] = set()

    # -- start / stop ---------------------------------------------------------------------

    def _slot(self, sandbox_id: str, job_id: str = "", ctx=None) -> int:
        """A free slot; waits (does not fail) while the node is at its cap."""
        while True:
            slot = self.lua("sandbox_alloc", slots=self.slots_key,
                            started=keys.SANDBOXES_STARTED, nodes=keys.SANDBOX_NODES,
                            job=keys.job(job_id) if job_id else "",
                            tenants=keys.sandbox_tenants(self.node),
                            cap=self.max_sandboxes, sandbox=sandbox_id,
                            hint=uuid.uuid4().int % self.max_sandboxes, node=self.node)
            if slot >= 0:
                return int(slot)
            if ctx is not None:
                ctx.sleep(0.2)  # raises on cancel or deadline
            else:
                time.sleep(0.2)

    def start(self, spec: SandboxSpec, job_id: str = "", requeues: int = 0, ctx=None) -> Sandbox:
        if spec.network and not self.allow_network:
            raise SandboxError("this node does not give sandboxes the outside network "
                               "(PRORL_SANDBOX_NETWORK)")
        sandbox_id = uuid.uuid4().hex[:12]
        slot = self._slot(sandbox_id, job_id, ctx)
        if job_id:
            self._started_for.add(job_id)
        base = self.root / sandbox_id
        cgroup = None
        workspace, run_dir = base / "workspace", base / "run"
        try:
            spec = self._prepare(spec, workspace, run_dir, ctx)
            cgroup = cgroups.create(sandbox_id, spec.limits.processes)
            sandbox = self.runtime.start(spec, sandbox_id, workspace, run_dir / "tools.sock",
                                         slot_ip(slot), cgroup)
        except BaseException:
            if cgroup is not None:
                cgroups.kill_all_and_remove(cgroup)
            self._release(sandbox_id, slot, base)
            raise
        sandbox.node = self.node
        sandbox.meta = {"slot": slot, "job_id": job_id, "requeues": requeues}
        with self.r.pipeline() as p:  # the record and the job's index of them, together
            p.hset(self.records_key, sandbox_id, json.dumps(sandbox.to_dict()))
            if job_id:
                p.sadd(keys.job_sandboxes(self.node, job_id), sandbox_id)
            p.execute()
        if ctx is not None:
            try:
                ctx.check()
            except (JobAborted, StageTimeout):
                self.stop(sandbox)
                raise
        return sandbox

    def _prepare(self, spec: SandboxSpec, workspace: Path, run_dir: Path, ctx) -> SandboxSpec:
        """The sandbox's directories (workspace, its scratch on disk, the tool server's run
        directory, the gateway's where it has one) and files, owned by the user it runs as;
        the spec with this node's bounds and CPU group, its read-only paths checked."""
        workspace.mkdir(parents=True)
        run_dir.mkdir()
        for scratch in disk_scratch(workspace).values():  # /tmp and /var/tmp, on disk
            scratch.mkdir()
            os.chmod(scratch, 0o1777)
        if spec.gateway:
            if not self.runtime.serves_gateway:
                raise SandboxError(f"the model gateway is not served to "
                                   f"{self.runtime.name} sandboxes (only to "
                                   f"{', '.join(GATEWAY_RUNTIMES)})")
            gw = gateway_dir(workspace)
            gw.mkdir()
            os.chmod(gw, 0o777)  # the RUN pool puts its socket here
        node = {k: v for k, v in (("scratch_bytes", self.scratch_bytes),
                                  ("workspace_bytes", self.workspace_bytes),
                                  ("cpu_group", getattr(ctx, "cpu_group", "") or None))
                if v is not None}
        if node:
            spec = dataclasses.replace(spec, limits=dataclasses.replace(spec.limits, **node))
        if spec.ro_paths:
            spec = dataclasses.replace(spec, ro_paths=check_ro_paths(
                spec.ro_paths, self.mount_roots + self.trusted_roots))
        for rel, text in spec.workspace_files.items():
            target = (workspace / rel).resolve()
            if not str(target).startswith(str(workspace.resolve()) + os.sep):
                raise SandboxError(f"workspace file {rel!r} escapes the workspace")
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(text, bytes):
                target.write_bytes(text)
            else:
                target.write_text(text)
        if self.run_as is not None:
            chown_tree(workspace, *self.run_as)
            for scratch in disk_scratch(workspace).values():
                os.chown(scratch, *self.run_as)
        return spec

    def adopt(self, sandbox: Sandbox | dict, job_id: str, requeues: int = 0) -> Sandbox | None:
        """A sandbox started for a warm handle (``meta.job_id`` "warm-...") becomes
        ``job_id``'s (attempt ``requeues``): stopped with the job, counted for its tenant.
        None if it is gone."""
        if isinstance(sandbox, dict):
            sandbox = Sandbox.from_dict(sandbox)
        was = sandbox.meta.get("job_id") or ""
        sandbox.meta = {**sandbox.meta, "job_id": job_id, "requeues": requeues}
        ok = self.lua("sandbox_adopt", records=self.records_key,
                      was=keys.job_sandboxes(self.node, was), index=keys.job_sandboxes(
                          self.node, job_id), job=keys.job(job_id),
                      tenants=keys.sandbox_tenants(self.node), sandbox=sandbox.id,
                      record=json.dumps(sandbox.to_dict()))
        if not ok:
            return None
        self._started_for.add(job_id)
        return sandbox

    def stop(self, sandbox: Sandbox | dict) -> None:
        """Stop it and free everything it held: processes, files, slot, record. Idempotent."""
        if isinstance(sandbox, dict):
            sandbox = Sandbox.from_dict(sandbox)
        try:
            self.runtime.stop(sandbox)
        finally:
            self._release(sandbox.id, sandbox.meta.get("slot"), self.root / sandbox.id,
                          sandbox.meta.get("job_id"))

    def _release(self, sandbox_id: str, slot, base: Path, job_id: str | None = None) -> None:
        shutil.rmtree(base, ignore_errors=True)
        if slot is not None:
            self.lua("sandbox_free", slots=self.slots_key,
                     tenants=keys.sandbox_tenants(self.node), slot=slot, sandbox=sandbox_id)
        with self.r.pipeline() as p:
            p.hdel(self.records_key, sandbox_id)
            if job_id:
                p.srem(keys.job_sandboxes(self.node, job_id), sandbox_id)
            p.execute()

    def snapshot(self, sandbox: Sandbox | dict, max_bytes: int = 64 * 1024 * 1024,
                 max_files: int = 10_000, skip_dirs: tuple[str, ...] = ()
                 ) -> dict[str, bytes]:
        """The regular files of a sandbox's workspace, read from the host side without
        following any link the agent made (symlinks, devices, fifos are left out), and
        without directories named in ``skip_dirs`` (e.g. ``.git``)."""
        if isinstance(sandbox, dict):
            sandbox = Sandbox.from_dict(sandbox)
        root = Path(sandbox.workspace)
        out: dict[str, bytes] = {}
        total = 0
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = [d for d in dirnames if d not in skip_dirs
                           and not os.path.islink(os.path.join(dirpath, d))]
            for name in filenames:
                path = os.path.join(dirpath, name)
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                except OSError:
                    continue  # a symlink, or gone
                with os.fdopen(fd, "rb") as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        continue
                    data = f.read(max_bytes - total + 1)
                total += len(data)
                if total > max_bytes or len(out) >= max_files:
                    raise SandboxError(f"workspace over {max_bytes} bytes or {max_files} files")
                out[os.path.relpath(path, root)] = data
        return out

    def stop_for_job(self, job_id: str) -> int:
        """Stop every sandbox of this node that belongs to ``job_id``: one read of the job's
        index when it has none, whatever else runs on the node."""
        self._started_for.discard(job_id)
        ids = self.r.smembers(keys.job_sandboxes(self.node, job_id))
        n = 0
        for record in (self.r.hmget(self.records_key, sorted(ids)) if ids else []):
            if record is not None:
                self.stop(Sandbox.from_dict(json.loads(record)))
                n += 1
        if ids:
            self.r.delete(keys.job_sandboxes(self.node, job_id))
        return n

    def take_started(self, job_id: str) -> bool:
        """Whether this process started a sandbox for ``job_id`` since it last asked (or
        since stop_for_job looked for them); forgets the job."""
        try:
            self._started_for.remove(job_id)
            return True
        except KeyError:
            return False

    # -- inventory ------------------------------------------------------------------------

    def records(self) -> list[Sandbox]:
        return [Sandbox.from_dict(json.loads(v)) for v in self.r.hvals(self.records_key)]

    def _lapsed(self, records: str, handle: str) -> bool:
        """Whether ``handle``'s record in the hash ``records`` is gone or past its
        ``until`` (a warm sandbox's, a warm grader's lease)."""
        raw = self.r.hget(records, handle)
        return raw is None or json.loads(raw).get("until", 0) < time.time()

    def janitor(self) -> int:
        """Stop sandboxes whose job is terminal, unknown or on a later attempt, and those
        whose processes are gone; free slots nobody holds. Returns how many it stopped."""
        stopped = 0
        records = self.records()
        for sandbox in records:
            job_id = sandbox.meta.get("job_id")
            if job_id and job_id.startswith(WARM_PREFIX):
                # A warm sandbox: stale once its warm record is gone or past its time (a
                # warmer that died mid-build or left it unused).
                stale = self._lapsed(keys.warm(self.node), job_id)
            elif job_id and job_id.startswith(GRADER_PREFIX):
                # A warm grader: stale once its pool stopped renewing its lease.
                stale = self._lapsed(keys.graders(self.node), job_id)
            elif job_id:
                state, requeues = self.r.hmget(keys.job(job_id), "state", "requeues")
                stale = (state is None or JobState(state) in TERMINAL_STATES
                         or int(requeues or 0) != sandbox.meta.get("requeues", 0))
            else:
                stale = False
            if stale or not self.runtime.alive(sandbox):
                log.info("janitor: stopping sandbox %s of job %s", sandbox.id, job_id)
                self.stop(sandbox)
                stopped += 1
        for handle in self.r.hkeys(keys.graders(self.node)):
            if self._lapsed(keys.graders(self.node), handle):
                self.r.hdel(keys.graders(self.node), handle)  # its sandbox is gone
        for slot, owner in self.r.hgetall(self.slots_key).items():
            if self.r.hexists(self.records_key, owner):
                continue
            # A slot whose start is still in progress has no record yet, but has its
            # directory or processes: free only slots with neither (their starter died).
            if not (self.root / owner).exists() and not processes_of(owner):
                self.lua("sandbox_free", slots=self.slots_key,
                         tenants=keys.sandbox_tenants(self.node), slot=slot, sandbox=owner)
        return stopped
