"""A private single-node Slurm from Debian packages (slurmctld, slurmd, munge), for the tests
of slurm/. Its config, spool, state and logs live in one directory; clients find it through
SLURM_CONF. Needs root (the daemons and the munge key)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install() -> str | None:
    """Install Slurm if missing; returns why it cannot be had, or None."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and cannot be (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if cmd[1] == "install" and out.returncode == 0:
            return None
    return f"apt-get could not install Slurm: {out.stderr[-500:]}"


class SlurmCluster:
    """slurmctld + slurmd on this machine, advertising ``cpus`` CPUs."""

    def __init__(self, root: Path, cpus: int = 16):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.cpus = cpus
        self._munged = False

    def _munge(self) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create", "--force"], check=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        for d in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
            self._munged = True

    def _resolvable(self) -> None:
        try:
            socket.gethostbyname(self.node)
        except OSError:
            with open("/etc/hosts", "a") as f:
                f.write(f"\n127.0.0.1 {self.node}\n")

    def start(self) -> None:
        self._munge()
        self._resolvable()
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text(f"""
ClusterName=prorltest
SlurmctldHost={self.node}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
ReturnToService=2
SlurmdParameters=config_overrides
MpiDefault=none
KillWait=20
InactiveLimit=0
MinJobAge=30
NodeName={self.node} CPUs={self.cpus} RealMemory=8000 State=UNKNOWN
PartitionName=main Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(self.conf)], env=self.env, check=True)
        subprocess.run(["/usr/sbin/slurmd", "-f", str(self.conf)], env=self.env, check=True)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            out = self.run("sinfo", "-h", "-N", "-o", "%t", check=False)
            if out.strip() in ("idle", "mix", "alloc"):
                return
            time.sleep(0.3)
        raise RuntimeError("slurmd never became idle:\n" + self.log_tail())

    def run(self, *argv: str, check: bool = True, env: dict | None = None) -> str:
        out = subprocess.run(list(argv), env={**self.env, **(env or {})}, capture_output=True,
                             text=True, timeout=60)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr}")
        return out.stdout

    def sbatch(self, script: Path, *args: str, env: dict | None = None) -> str:
        """Submit; returns the job id."""
        return self.run("sbatch", "--parsable", *args, str(script), env=env).strip().split(";")[0]

    def state(self, job_id: str) -> str:
        """squeue's state of a job ('' once it left the queue)."""
        return self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).strip()

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i", check=False).split()

    def log_tail(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-20:]))
        return "\n".join(out)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        end = time.monotonic() + 40
        while self.jobs() and time.monotonic() < end:
            time.sleep(0.5)
        for name in ("slurmd.pid", "slurmctld.pid"):
            pid_file = self.root / name
            if pid_file.exists():
                try:
                    pid = int(pid_file.read_text())
                    os.kill(pid, 15)
                    for _ in range(100):
                        os.kill(pid, 0)
                        time.sleep(0.1)
                except (ValueError, ProcessLookupError):
                    pass
        if self._munged:
            subprocess.run(["pkill", "-x", "munged"], check=False)
