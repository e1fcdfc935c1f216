"""A virtual cluster on one machine: network namespaces as hosts on a bridge, and faults on their links.

Each host is a network namespace with its own address (``10.231.S.i+1/24``) on a veth pair whose other end sits on a
bridge in the root namespace; nothing is routed outside the bridge. ``ip netns exec`` bind-mounts
``/etc/netns/NAME/hosts`` over ``/etc/hosts``, so the machine's hostname resolves to the host's own address there:
gloo (JAX's CPU collectives) listens on the address the hostname resolves to, as on a real cluster node.

Faults: :meth:`VirtualCluster.impair` adds delay and loss to a host's outgoing packets with ``tc netem`` when the
kernel has it, else through an NFQUEUE rule (iptables) served by ``nfdelay.py`` (user space, standard library);
:meth:`VirtualCluster.link_down` cuts a host off the bridge. Needs root, ``ip`` (iproute2) and, for the NFQUEUE path,
``iptables``; :func:`unavailable` says what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))


def _sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


def unavailable() -> str | None:
    """Why namespaces cannot be used here (a skip reason), or ``None``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed (apt-get install iproute2)"
    probe = f"sxprobe{os.getpid() % 100000}"
    made = _sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def netem_available(namespace: str, device: str) -> bool:
    """Whether ``tc qdisc ... netem`` works (the kernel may lack sch_netem: "Specified qdisc kind is unknown")."""
    added = _sh("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "netem", "delay",
                "1ms", check=False)
    if added.returncode == 0:
        _sh("ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root", check=False)
    return added.returncode == 0


class VirtualCluster:
    """``num_hosts`` network namespaces on one bridge; use as a context manager (tears everything down)."""

    def __init__(self, num_hosts: int = 2, *, tag: str | None = None) -> None:
        self.tag = tag or f"sx{os.getpid() % 100000}"
        self.subnet = 16 + os.getpid() % 200
        self.num_hosts = num_hosts
        self.bridge = f"{self.tag}br"
        self.hosts = [f"{self.tag}h{i}" for i in range(num_hosts)]
        self.links = [f"{self.tag}v{i}" for i in range(num_hosts)]
        self.ips = [f"10.231.{self.subnet}.{i + 1}" for i in range(num_hosts)]
        self._helpers: dict[str, subprocess.Popen[str]] = {}
        self.fault_method: dict[str, str] = {}

    def __enter__(self) -> VirtualCluster:
        try:
            self._up()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _up(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        hostname = os.uname().nodename
        for ns, link, ip in zip(self.hosts, self.links, self.ips, strict=True):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", link, "master", self.bridge, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            with open(f"{etc}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{ip} {hostname}\n")
                f.writelines(f"{other_ip} {other}\n" for other, other_ip in zip(self.hosts, self.ips, strict=True))

    def teardown(self) -> None:
        """Stop helpers, delete namespaces, links and the bridge (idempotent, never raises)."""
        for proc in self._helpers.values():
            with contextlib.suppress(Exception):
                proc.terminate()
                proc.communicate(timeout=5)
        self._helpers.clear()
        for ns, link in zip(self.hosts, self.links, strict=True):
            _sh("ip", "netns", "del", ns, check=False)
            _sh("ip", "link", "del", link, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        _sh("ip", "link", "del", self.bridge, check=False)

    def popen(self, host: int, argv: Sequence[str], env: Mapping[str, str], stdout: int | None = None,
              ) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``host`` (inside its namespace) with exactly the environment ``env``."""
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *argv], env=dict(env), text=True,
                                stdout=stdout if stdout is not None else subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def faults_unavailable(self) -> str | None:
        """Why :meth:`impair` cannot work here (a skip reason), or ``None``."""
        if netem_available(self.hosts[0], "eth0") or shutil.which("iptables") is not None:
            return None
        return "the kernel has no sch_netem and iptables (for the NFQUEUE fallback) is not installed"

    def impair(self, host: int, *, delay_ms: float = 0.0, loss: float = 0.0, lifetime_s: float = 600) -> str:
        """Delay by ``delay_ms`` and drop a fraction ``loss`` of what ``host`` sends; returns the method used."""
        ns = self.hosts[host]
        if netem_available(ns, "eth0"):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
                f"{delay_ms}ms", "loss", f"{loss * 100}%")
            self.fault_method[ns] = "tc netem"
            return "tc netem"
        if shutil.which("iptables") is None:
            raise RuntimeError("the kernel has no sch_netem and iptables (for the NFQUEUE fallback) is missing: "
                               "apt-get install iptables")
        ready = os.path.join(tempfile.mkdtemp(prefix="sxnf"), "ready")
        self._helpers[ns] = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, os.path.join(HERE, "nfdelay.py"), "--delay-ms",
             str(delay_ms), "--loss", str(loss), "--lifetime-s", str(lifetime_s), "--ready-file", ready],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while not os.path.exists(ready):
            if self._helpers[ns].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nfdelay did not start: {self._helpers[ns].communicate()[1]}")
            time.sleep(0.05)
        _sh("ip", "netns", "exec", ns, "iptables", "-A", "OUTPUT", "-d", f"10.231.{self.subnet}.0/24", "-j",
            "NFQUEUE", "--queue-num", "0", "--queue-bypass")
        self.fault_method[ns] = "NFQUEUE (nfdelay.py): this kernel has no sch_netem"
        return self.fault_method[ns]

    def clear(self, host: int) -> None:
        """Remove the delay and loss that :meth:`impair` added to ``host``."""
        ns = self.hosts[host]
        method = self.fault_method.pop(ns, None)
        if method == "tc netem":
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        elif method is not None:
            _sh("ip", "netns", "exec", ns, "iptables", "-F", "OUTPUT", check=False)
            helper = self._helpers.pop(ns)
            helper.terminate()
            helper.communicate(timeout=10)

    def link_down(self, host: int) -> None:
        """Take ``host``'s link to the bridge down (packets to and from it are lost from now on)."""
        _sh("ip", "link", "set", self.links[host], "down")

    def ping_ms(self, source: int, target: int, count: int = 10) -> float:
        """Median round trip in ms over a TCP connect (no ping binary needed): connect, then close."""
        code = ("import socket,statistics,sys,time\n"
                "s=socket.socket();s.bind(('0.0.0.0',0));s.listen(64);port=s.getsockname()[1]\n"
                "print(port,flush=True);time.sleep(60)")
        server = self.popen(target, [sys.executable, "-c", code], os.environ)
        assert server.stdout is not None
        port = int(server.stdout.readline())
        probe = (f"import socket,statistics,time\nts=[]\nfor _ in range({count}):\n"
                 f"    t=time.perf_counter();c=socket.create_connection(('{self.ips[target]}',{port}),timeout=5)\n"
                 "    ts.append(time.perf_counter()-t);c.close()\nprint(statistics.median(ts)*1e3)")
        out = _sh("ip", "netns", "exec", self.hosts[source], sys.executable, "-c", probe)
        server.kill()
        server.communicate(timeout=5)
        return float(out.stdout)

    def launch(self, argv: Sequence[str], *, cpu_devices: int, timeout_s: float, port: int = 47001,
               env: Mapping[str, str] | None = None, grace_s: float | None = None) -> list[tuple[int, str]]:
        """Run ``argv`` as process i on host i, coordinator on host 0 (a static config: explicit address).

        Each process gets ``SHARDAX_COORDINATOR_ADDRESS=<host 0>:port``, ``SHARDAX_NUM_PROCESSES``,
        ``SHARDAX_PROCESS_ID`` and ``SHARDAX_CPU_DEVICES``; returns ``(exit code, output)`` per process. A process
        still running after ``timeout_s`` is killed (exit code -9): nothing here waits longer. With ``grace_s``,
        the first non-zero exit ends the others ``grace_s`` later, as ``srun``, ``mpirun`` and ``shardax launch`` do.
        """
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDAX_", "OMPI_", "PMIX_", "SLURM_"))}
        base |= dict(env or {})
        base |= {"SHARDAX_COORDINATOR_ADDRESS": f"{self.ips[0]}:{port}", "SHARDAX_NUM_PROCESSES": str(self.num_hosts),
                 "SHARDAX_CPU_DEVICES": str(cpu_devices), "JAX_NUM_CPU_DEVICES": str(cpu_devices),
                 "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
        with contextlib.ExitStack() as stack:
            logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(self.num_hosts)]
            procs = [self.popen(i, argv, base | {"SHARDAX_PROCESS_ID": str(i)}, stdout=logs[i].fileno())
                     for i in range(self.num_hosts)]
            deadline = time.monotonic() + timeout_s
            first_failure: float | None = None
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                    first_failure = time.monotonic()
                if grace_s is not None and first_failure is not None and time.monotonic() > first_failure + grace_s:
                    break
                time.sleep(0.05)
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, 9)
            codes = [proc.wait(timeout=10) for proc in procs]
            results = []
            for code, log in zip(codes, logs, strict=True):
                log.seek(0)
                results.append((code, log.read()))
        return results


@contextlib.contextmanager
def virtual_cluster(num_hosts: int = 2) -> Iterator[VirtualCluster]:
    """``with virtual_cluster(2) as vc:`` — the namespaces exist inside the block only."""
    with VirtualCluster(num_hosts) as cluster:
        yield cluster
