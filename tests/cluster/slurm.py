"""A single-node Slurm for tests: munged, slurmctld and slurmd from Debian's packages, all state in a temp dir.

Nothing touches the machine's own Slurm or munge set-up: a fresh munge key and socket, a ``slurm.conf`` on private
ports (``SLURM_CONF`` points ``srun`` at it), daemons started here and stopped by the pids they wrote. The node
declares 8 CPUs (``SlurmdParameters=config_overrides``) so that several tasks fit on a 2-core machine.

    with LocalSlurm() as slurm:
        done = slurm.srun(["-n", "2", sys.executable, "script.py"], timeout_s=120)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


def unavailable() -> str | None:
    """Why a local Slurm cannot start here (a skip reason), or ``None``."""
    if os.geteuid() != 0:
        return "a local Slurm runs its daemons as root here"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    return None


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class LocalSlurm:
    """A one-node Slurm cluster (``debug`` partition) that lives as long as the ``with`` block."""

    def __init__(self, cpus: int = 8) -> None:
        self.dir = tempfile.mkdtemp(prefix="sxslurm")
        self.cpus = cpus
        self.node = os.uname().nodename
        base = 40000 + (os.getpid() % 5000) * 2
        self.ports = (base, base + 1)
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.munge_socket = os.path.join(self.dir, "munge", "munge.sock")

    def _path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    def _write_config(self) -> None:
        os.makedirs(self._path("munge"), mode=0o700)
        for sub in ("state", "spool"):
            os.makedirs(self._path(sub))
        with open(self._path("munge", "munge.key"), "wb") as f:
            f.write(os.urandom(128))
        os.chmod(self._path("munge", "munge.key"), 0o600)
        lines = {
            "ClusterName": "sxtest", "SlurmctldHost": f"{self.node}(127.0.0.1)", "SlurmUser": "root",
            "SlurmdUser": "root", "AuthType": "auth/munge", "AuthInfo": f"socket={self.munge_socket}",
            "CredType": "cred/munge", "SlurmctldPort": str(self.ports[0]), "SlurmdPort": str(self.ports[1]),
            "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none", "MpiDefault": "none",
            "ReturnToService": "2", "SchedulerType": "sched/builtin", "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU", "SlurmdParameters": "config_overrides",
            "StateSaveLocation": self._path("state"), "SlurmdSpoolDir": self._path("spool"),
            "SlurmctldPidFile": self._path("slurmctld.pid"), "SlurmdPidFile": self._path("slurmd.pid"),
            "SlurmctldLogFile": self._path("slurmctld.log"), "SlurmdLogFile": self._path("slurmd.log"),
            "JobCompType": "jobcomp/none", "AccountingStorageType": "accounting_storage/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "NodeName": f"{self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            "PartitionName": f"debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        }
        with open(self.conf, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in lines.items())

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SHARDAX_", "OMPI_", "PMIX_"))}
        return keep | {"SLURM_CONF": self.conf} | dict(extra or {})

    def __enter__(self) -> LocalSlurm:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        self._write_config()
        m = self._path("munge")
        subprocess.run(["munged", "--force", f"--socket={self.munge_socket}", f"--key-file={m}/munge.key",
                        f"--log-file={m}/munged.log", f"--pid-file={m}/munged.pid", f"--seed-file={m}/seed"],
                       check=True, capture_output=True, timeout=30)
        subprocess.run(["slurmctld", "-f", self.conf, "-c"], check=True, capture_output=True, env=self.env(),
                       timeout=30)
        subprocess.run(["slurmd", "-f", self.conf, "-N", self.node], check=True, capture_output=True,
                       env=self.env(), timeout=30)
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self.env(),
                                   timeout=10).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.3)
        raise RuntimeError(f"the local Slurm node did not become idle within 30 s (state {state!r}); "
                           f"slurmctld.log:\n{self.log('slurmctld.log')}\nslurmd.log:\n{self.log('slurmd.log')}")

    def log(self, name: str) -> str:
        with contextlib.suppress(OSError), open(self._path(name)) as f:
            return f.read()[-3000:]
        return ""

    def srun(self, args: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
        """``srun ARGS`` against this cluster; killed after ``timeout_s`` (returncode -9)."""
        proc = subprocess.Popen(["srun", "--kill-on-bad-exit=1", *args], env=self.env(env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=10)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def stop(self) -> None:
        """Stop the daemons this instance started (by their pid files) and remove its directory."""
        for pidfile in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            with contextlib.suppress(OSError, ValueError), open(self._path(pidfile)) as f:
                pid = int(f.read().strip())
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
        shutil.rmtree(self.dir, ignore_errors=True)
