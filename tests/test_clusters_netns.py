"""Multi-host runs over a real (virtual) network: a link taken down mid-run ends the run through the watchdog.

Each host is a network namespace with its own address on a bridge (tests/cluster/netns.py); the processes find each
other through a static config (explicit coordinator on host 0, as on Kubernetes) and gloo's traffic crosses the
veth links. A link taken down mid-run must end the run through the watchdog, naming the lost process. (The whole
pipeline on two such hosts, clean and then with delay and loss on every link, is tests/test_pipeline.py's 2 x 4
run.) Needs root and iproute2 (skipped otherwise, with the reason).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "cluster"))

import netns  # noqa: E402

REASON = netns.unavailable()
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

WATCHDOG_S = 8


def test_link_down_mid_run_ends_with_the_lost_process_named(tmp_path) -> None:
    ready = tmp_path / "ready"
    cut_at: list[float] = []
    with netns.virtual_cluster(2) as cluster:
        def cut_when_ready() -> None:
            deadline = time.monotonic() + 120
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            cluster.link_down(1)
            cut_at.append(time.monotonic())

        cutter = threading.Thread(target=cut_when_ready, daemon=True)
        cutter.start()
        runs = cluster.launch([sys.executable, os.path.join(HERE, "cluster", "linkdown.py"), "--ready-file",
                               str(ready), "--max-s", "90", "--watchdog-s", str(WATCHDOG_S)], cpu_devices=2,
                              timeout_s=150, grace_s=5)
        ended = time.monotonic()
        cutter.join(timeout=1)
    assert cut_at, f"the run never got ready:\n{runs[0][1][-3000:]}"
    text = "\n".join(t for _, t in runs)
    assert "loop finished" not in text, f"a process reported a complete run:\n{text[-3000:]}"
    code0, out0 = runs[0]
    assert code0 == 75, f"process 0 should end through the watchdog (exit 75), got {code0}:\n{out0[-3000:]}"
    assert "shardax watchdog: process 0: distributed call" in out0
    assert "process 1: no report" in out0, out0[-3000:]
    assert runs[1][0] != 0
    # the watchdog's limit, its 5 s collection of the others' reports, the launcher's 5 s grace, start-up slack
    assert ended - cut_at[0] < WATCHDOG_S + 5 + 5 + 10, f"the run took {ended - cut_at[0]:.0f} s to end"
