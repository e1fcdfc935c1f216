"""Network benchmarks: collectives and the pipeline between two network-namespace hosts vs loopback, and with faults.

Needs root and iproute2 (+ iptables where the kernel has no sch_netem); run once, it takes a few minutes:

    sudo python benchmarks/network.py                   # markdown tables on stdout
    sudo python benchmarks/network.py --json net.json   # and the raw figures

What it measures (two processes x ``--cpu-devices`` CPU devices, as in tests/test_pipeline.py):

1. TCP connect round trip (one SYN/SYN-ACK) between the two processes' hosts: loopback, namespaces, namespaces with
   5 ms delay on every link.
2. ``shardax doctor``'s collective self-test (allreduce, alltoall, alltoallv; median time, GB/s per device) with a
   small message (latency) and a large one (bandwidth), on loopback (``shardax doctor --processes 2``) and between
   the namespace hosts (``shardax doctor`` as the program on each host, explicit coordinator).
3. The pipeline of tests/cluster/pipeline.py (collectives, zsort, knn, fof, potrs, fftn): warm medians in ONE run
   whose network changes between phases: clean, 5 ms delay, 1% loss, 5 ms + 1% loss (on every link), so the
   slowdowns are measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))

import netns  # noqa: E402

ROW = re.compile(r"(allreduce|alltoall|alltoallv)\s+([\d.]+ \w+)\s+([\d.]+ \w+)\s+([\d.]+)\s+(PASS|FAIL)")
PHASES = (("clean", 0.0, 0.0), ("5 ms delay", 5.0, 0.0), ("1% loss", 0.0, 0.01), ("5 ms + 1% loss", 5.0, 0.01))


def doctor_rows(output: str) -> dict[str, dict[str, str]]:
    rows = {m.group(1): {"message": m.group(2), "time": m.group(3), "gbps": m.group(4), "result": m.group(5)}
            for m in ROW.finditer(output)}
    if not rows or any(r["result"] != "PASS" for r in rows.values()):
        raise RuntimeError(f"shardax doctor failed or printed no self-test:\n{output[-3000:]}")
    return rows


def doctor_loopback(cpu_devices: int, size_mb: float, repeats: int) -> dict[str, dict[str, str]]:
    done = subprocess.run([sys.executable, "-m", "shardax.cli", "doctor", "--processes", "2", "--cpu-devices",
                           str(cpu_devices), "--plain", "--size-mb", str(size_mb), "--repeats", str(repeats)],
                          capture_output=True, text=True, timeout=600)
    return doctor_rows(done.stdout + done.stderr)


def doctor_hosts(cluster: netns.VirtualCluster, cpu_devices: int, size_mb: float, repeats: int,
                 ) -> dict[str, dict[str, str]]:
    runs = cluster.launch([sys.executable, "-m", "shardax.cli", "doctor", "--plain", "--size-mb", str(size_mb),
                           "--repeats", str(repeats)], cpu_devices=cpu_devices, timeout_s=600, grace_s=5)
    return doctor_rows(runs[0][1])


def rtt_loopback_ms(count: int = 20) -> float:
    import socket
    import statistics

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    times = []
    for _ in range(count):
        start = time.perf_counter()
        socket.create_connection(server.getsockname(), timeout=5).close()
        times.append(time.perf_counter() - start)
    server.close()
    return statistics.median(times) * 1e3


def pipeline_phases(cluster: netns.VirtualCluster, cpu_devices: int, repeats: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as sync:
        def switch() -> None:
            for phase, (_, delay, loss) in enumerate(PHASES[1:], start=1):
                deadline = time.monotonic() + 900
                while not os.path.exists(f"{sync}/phase{phase}.ready") and time.monotonic() < deadline:
                    time.sleep(0.05)
                for host in range(cluster.num_hosts):
                    cluster.clear(host)
                    cluster.impair(host, delay_ms=delay, loss=loss)
                open(f"{sync}/phase{phase}.go", "w").close()

        switcher = threading.Thread(target=switch, daemon=True)
        switcher.start()
        out = f"{sync}/result.npz"
        runs = cluster.launch([sys.executable, os.path.join(ROOT, "tests", "cluster", "pipeline.py"), "--out", out,
                               "--repeats", str(repeats), "--phases", str(len(PHASES)), "--sync-dir", sync],
                              cpu_devices=cpu_devices, timeout_s=1800, grace_s=5)
        for host in range(cluster.num_hosts):
            cluster.clear(host)
        if any(code != 0 for code, _ in runs):
            raise RuntimeError(f"pipeline run failed:\n{runs[0][1][-3000:]}\n{runs[1][1][-3000:]}")
        with np.load(out) as data:
            warm = data["warm_s"]
            stages = {k.removeprefix("time_"): np.median(data[k], axis=1) for k in data.files if k.startswith("time_")}
    result = {}
    for phase, (name, _, _) in enumerate(PHASES):
        result[name] = float(np.median(warm[phase]))
        for stage, medians in stages.items():
            result[f"{name} / {stage}"] = float(medians[phase])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cpu-devices", type=int, default=4)
    parser.add_argument("--small-mb", type=float, default=1 / 256, help="latency message per device (MiB)")
    parser.add_argument("--large-mb", type=float, default=4.0, help="bandwidth message per device (MiB)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pipeline-repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reason = netns.unavailable()
    if reason:
        print(f"network.py: {reason}", file=sys.stderr)
        return 2
    figures: dict[str, object] = {"cpu_devices": args.cpu_devices}
    figures["rtt_ms loopback"] = rtt_loopback_ms()
    with netns.virtual_cluster(2) as cluster:
        figures["rtt_ms namespaces"] = cluster.ping_ms(1, 0, count=20)
        for host in range(2):
            figures["faults by"] = cluster.impair(host, delay_ms=5.0)
        figures["rtt_ms namespaces + 5 ms"] = cluster.ping_ms(1, 0, count=20)
        for host in range(2):
            cluster.clear(host)
        for label, size in (("small", args.small_mb), ("large", args.large_mb)):
            figures[f"doctor {label} loopback"] = doctor_loopback(args.cpu_devices, size, args.repeats)
            figures[f"doctor {label} namespaces"] = doctor_hosts(cluster, args.cpu_devices, size, args.repeats)
        figures["pipeline"] = pipeline_phases(cluster, args.cpu_devices, args.pipeline_repeats)

    print(f"## Network ({args.cpu_devices} CPU devices per process, 2 processes)\n")
    print("| TCP connect round trip | ms |\n|---|---|")
    for key in ("loopback", "namespaces", "namespaces + 5 ms"):
        print(f"| {key} | {figures[f'rtt_ms {key}']:.3f} |")
    print("\n| collective | message/device | loopback | namespaces |\n|---|---|---|---|")
    for label in ("small", "large"):
        lo, ns = figures[f"doctor {label} loopback"], figures[f"doctor {label} namespaces"]
        assert isinstance(lo, dict) and isinstance(ns, dict)
        for name in ("allreduce", "alltoall", "alltoallv"):
            print(f"| {name} | {lo[name]['message']} | {lo[name]['time']} ({lo[name]['gbps']} GB/s) | "
                  f"{ns[name]['time']} ({ns[name]['gbps']} GB/s) |")
    pipe = figures["pipeline"]
    assert isinstance(pipe, dict)
    clean = pipe["clean"]
    print(f"\n| pipeline phase (faults by {figures['faults by']}) | warm median s | slowdown |\n|---|---|---|")
    for name, _, _ in PHASES:
        print(f"| {name} | {pipe[name]:.3f} | {pipe[name] / clean:.1f}x |")
    stages = sorted({k.split(" / ")[1] for k in pipe if " / " in k})
    print("\n| stage | " + " | ".join(n for n, _, _ in PHASES) + " |\n|---|" + "---|" * len(PHASES))
    for stage in stages:
        print(f"| {stage} | " + " | ".join(f"{pipe[f'{n} / {stage}']:.3f}" for n, _, _ in PHASES) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    from shardax.runtime import restart_with_malloc_env

    # glibc's allocator as in the processes shardax launches (SHARDAX_MALLOC=system: its defaults)
    restart_with_malloc_env(sys.argv)
    sys.exit(main())
