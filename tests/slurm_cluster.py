"""A real single-node SLURM cluster on loopback for tests: Debian's slurm-wlm + munge, no systemd.

``local_slurm(tmp)`` installs the packages when they are missing (as root, with apt-get), writes a
slurm.conf under ``tmp`` (copied to /etc/slurm/slurm.conf, where the job steps' ``srun`` looks, and
restored or removed afterwards), starts munged, slurmctld and slurmd in the foreground as child
processes, waits for the node to be idle, and stops every daemon by its PID on exit. Jobs are recorded
in ``tmp/jobcomp.txt`` (``jobcomp/filetxt``), read back with :func:`read_jobcomp`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ETC_CONF = Path("/etc/slurm/slurm.conf")
DAEMONS = ("sbatch", "squeue", "sinfo", "scancel", "slurmctld", "slurmd", "munged")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        raise AssertionError(f"{reason}, and CI must run every test")
    pytest.skip(reason)


OPT_IN_ENV = "AERIE_TEST_SLURM"  # set to 1 to let the tests install SLURM and start its daemons (CI always does)


def ensure_slurm_installed() -> None:
    """Install slurm-wlm and munge with apt-get when a command is missing (root only).

    Installing system packages and starting root daemons is opt-in outside CI: without AERIE_TEST_SLURM=1 the
    SLURM test is skipped with a reason (CI=true always runs it)."""
    if os.environ.get("CI") != "true" and os.environ.get(OPT_IN_ENV) != "1":
        pytest.skip(f"the SLURM test installs slurm-wlm and starts root daemons: opt in with {OPT_IN_ENV}=1")
    try:
        import snakemake_executor_plugin_slurm  # noqa: F401 - profiles/slurm's executor
    except ImportError:
        _unavailable('snakemake-executor-plugin-slurm is not installed (pip install -e ".[test]")')
    missing = [d for d in DAEMONS if _which(d) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        _unavailable(f"SLURM is not installed ({', '.join(missing)} missing) and this is not root with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:  # a fresh image has no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=900)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"apt-get install slurm-wlm munge failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    missing = [d for d in DAEMONS if _which(d) is None]
    assert not missing, f"still missing after installing slurm-wlm and munge: {missing}"


def _mem_total_mb() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 2048


def slurm_conf(d: Path, munge_dir: Path, cpus: int, real_memory_mb: int) -> str:
    return f"""\
ClusterName=aerietest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_dir}/munge.socket.2
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/jobcomp.txt
MinJobAge=300
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={real_memory_mb} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    dir: Path
    conf: Path
    cpus: int
    real_memory_mb: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def jobcomp(self) -> Path:
        return self.dir / "jobcomp.txt"

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, timeout: int = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, env=self.env(), timeout=timeout)

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.out"):
            p = self.dir / name
            if p.exists():
                out.append(f"--- {name}\n" + p.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def queued_job_ids(self) -> list[str]:
        proc = self.run("squeue", "-h", "-o", "%i")
        return proc.stdout.split() if proc.returncode == 0 else []


def read_jobcomp(path: Path) -> dict[str, dict[str, str]]:
    """The job-completion records (``jobcomp/filetxt``: one ``Key=Value ...`` line per job) by JobId."""
    records: dict[str, dict[str, str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "JobId" in fields:
                records[fields["JobId"]] = fields
    return records


def _stop(proc: subprocess.Popen, pid: int | None = None, wait_s: float = 15) -> None:
    """SIGTERM the daemon (``pid`` when it is not the Popen's own process), then SIGKILL if it lingers."""
    target = pid or proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(target, signal.SIGTERM)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
        if target != proc.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def local_slurm(d: Path, cpus: int | None = None) -> Iterator[Cluster]:
    """A started single-node cluster with partition ``debug``; every daemon is stopped on exit."""
    ensure_slurm_installed()
    if os.geteuid() != 0:
        _unavailable("starting slurmctld/slurmd/munged needs root")
    d.mkdir(parents=True, exist_ok=True)
    cpus = cpus or os.cpu_count() or 1
    # Memory is not a consumable (CR_Core) here; RealMemory only bounds what a job may ask (--mem).
    cluster = Cluster(d, d / "slurm.conf", cpus, max(1024, min(8000, _mem_total_mb() // 2)))
    for sub in ("state", "spool"):
        (d / sub).mkdir(exist_ok=True)
    # munged runs as user munge and checks every directory above its files: a 0700 root-owned pytest
    # temp dir is refused, so its socket, pid, log and seed live in a munge-owned dir directly in /tmp.
    munge_dir = Path(tempfile.mkdtemp(prefix="aerie-munge-"))
    shutil.chown(munge_dir, "munge", "munge")
    munge_dir.chmod(0o755)
    cluster.conf.write_text(slurm_conf(d, munge_dir, cluster.cpus, cluster.real_memory_mb))
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o600)

    # The job steps (srun inside each sbatch job) read the default path: SLURM_CONF is not passed on.
    backup = ETC_CONF.read_bytes() if ETC_CONF.exists() else None
    ETC_CONF.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cluster.conf, ETC_CONF)
    munged_pid = munge_dir / "munged.pid"
    logs = {name: open(d / f"{name}.out", "w") for name in ("munged", "slurmctld", "slurmd")}
    try:
        cluster.procs["munged"] = subprocess.Popen(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                _which("munged"),
                "-F",
                "-S",
                str(munge_dir / "munge.socket.2"),
                f"--pid-file={munged_pid}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            stdout=logs["munged"],
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 20
        while not (munge_dir / "munge.socket.2").exists():
            assert cluster.procs["munged"].poll() is None and time.time() < deadline, (
                "munged did not start:\n" + (d / "munged.out").read_text()
            )
            time.sleep(0.2)
        cluster.procs["slurmctld"] = subprocess.Popen(
            [_which("slurmctld"), "-D", "-i", "-f", str(cluster.conf)],
            stdout=logs["slurmctld"],
            stderr=subprocess.STDOUT,
            env=cluster.env(),
        )
        cluster.procs["slurmd"] = subprocess.Popen(
            [_which("slurmd"), "-D", "-N", "localhost", "-f", str(cluster.conf)],
            stdout=logs["slurmd"],
            stderr=subprocess.STDOUT,
            env=cluster.env(),
        )
        deadline = time.time() + 60
        while True:
            for name, proc in cluster.procs.items():
                assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{cluster.logs()}"
            state = cluster.run("sinfo", "-h", "-n", "localhost", "-o", "%t").stdout.strip()
            if state == "idle":
                break
            assert time.time() < deadline, f"the node is {state!r}, not idle, after 60 s:\n{cluster.logs()}"
            time.sleep(0.5)
        yield cluster
    finally:
        # Jobs still queued or running (a failed or timed-out run) are cancelled before the daemons go.
        if "slurmctld" in cluster.procs and cluster.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                ids = cluster.queued_job_ids()
                if ids:
                    cluster.run("scancel", *ids)
                    time.sleep(3)
        for name in ("slurmd", "slurmctld"):
            if name in cluster.procs:
                _stop(cluster.procs[name])
        if "munged" in cluster.procs:
            pid = None
            with contextlib.suppress(OSError, ValueError):
                pid = int(munged_pid.read_text().strip())
            _stop(cluster.procs["munged"], pid)
        for f in logs.values():
            f.close()
        with contextlib.suppress(OSError):
            shutil.copyfile(munge_dir / "munged.log", d / "munged.log")
        shutil.rmtree(munge_dir, ignore_errors=True)
        if backup is None:
            ETC_CONF.unlink(missing_ok=True)
        else:
            ETC_CONF.write_bytes(backup)
