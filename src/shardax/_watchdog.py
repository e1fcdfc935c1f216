"""Watchdog: a distributed call that does not finish in time ends the run with a report instead of a hang.

A hung collective cannot be interrupted from Python, so the watchdog reports and then ends the process
(``os._exit(75)``); the launcher (``shardax launch``, ``mpirun``, ``srun``) then ends the other processes. Each
watched call is queued with its description and its outputs; a thread checks twice a second whether the oldest
unfinished call's outputs are ready (``is_ready``, never blocking) and how old it is, and drops the calls that have
finished (so does each new call). A call costs the caller a few microseconds: no thread is woken per call (a waiting
thread cost ~40 us per call under mpirun). A finished call's outputs are let go before the next call is dispatched,
or within half a second. Before exiting, the process posts what it was doing to the distributed
key-value store and prints what the other processes posted within a few seconds (their watchdogs fire too).

Configure with ``SHARDAX_WATCHDOG_S`` (seconds; ``0`` disables; default 1800 in multi-process runs, off in one
process) or :func:`configure_watchdog`.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import sys
import threading
import time
from typing import Any

import jax

EXIT_CODE = 75


@dataclasses.dataclass
class _Pending:
    number: int
    description: str
    started: float
    outputs: list[jax.Array]  # the call's output arrays, until the call is seen finished
    timeout_s: float

    def finished(self) -> bool:
        """Whether every output is ready (never blocks). The outputs are held, not weakly referenced: a caller may
        drop the global array and wait on one of its shards (``out.addressable_shards[0].data``)."""
        for array in self.outputs:
            try:
                if not array.is_ready():  # pyright: ignore[reportAttributeAccessIssue]
                    return False
            except Exception:  # deleted (donated) or failed: nothing left to wait for
                continue
        return True


def _arrays(outputs: Any) -> list[jax.Array]:
    return [leaf for leaf in jax.tree.leaves(outputs) if isinstance(leaf, jax.Array)]


class _Watchdog:
    def __init__(self) -> None:
        env = os.environ.get("SHARDAX_WATCHDOG_S")
        self.timeout_s: float | None = float(env) if env not in (None, "") else None
        self.queue: collections.deque[_Pending] = collections.deque()
        self.cond = threading.Condition()
        self.threads_started = False
        self.stopping = False
        self.monitor: threading.Thread | None = None
        self.last_done = ""
        self.process = (0, 1)  # (index, count), read in the caller's thread: the monitor only asks is_ready()

    def effective_timeout(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return 1800.0 if jax.process_count() > 1 else 0.0

    def watch(self, number: int, description: str, outputs: Any) -> None:
        timeout = self.effective_timeout()
        if timeout <= 0:
            return
        pending = _Pending(number, description, time.monotonic(), _arrays(outputs), timeout)
        with self.cond:
            if not self.threads_started:
                self.monitor = threading.Thread(target=self._monitor, name="shardax-watchdog", daemon=True)
                self.monitor.start()
                self.threads_started = True
                # Stop before interpreter finalization: a daemon thread caught inside a JAX call then aborts.
                atexit.register(self._stop)
            self.process = (jax.process_index(), jax.process_count())
            self._prune()
            self.queue.append(pending)

    def _prune(self) -> None:
        """Drop the finished calls at the head of the queue (holding ``cond``)."""
        while self.queue and self.queue[0].finished():
            item = self.queue.popleft()
            self.last_done = f"#{item.number} {item.description}"

    def _monitor(self) -> None:
        while not self.stopping:
            with self.cond:
                self.cond.wait(timeout=0.5)  # _stop wakes it at once
                if self.stopping:
                    return
                self._prune()
                oldest = self.queue[0] if self.queue else None
                limit = self.timeout_s if self.timeout_s is not None else (oldest.timeout_s if oldest else 0.0)
            if oldest is None or limit <= 0:
                continue
            age = time.monotonic() - oldest.started
            if age > limit:
                self._fire(oldest, age)

    def _stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.queue.clear()
            self.cond.notify_all()
        if self.monitor is not None:
            self.monitor.join(timeout=10.0)

    def _fire(self, item: _Pending, age: float) -> None:
        me, count = self.process
        mine = (f"process {me}: distributed call #{item.number} {item.description} has not finished after "
                f"{age:.0f} s (last finished: {self.last_done or 'none'})")
        lines = [f"shardax watchdog: {mine}"]
        others: list[str] = []
        # The coordinator may be unreachable (a cut link): collect in a thread, wait at most a few seconds.
        collector = threading.Thread(target=self._collect, args=(me, count, mine, others), daemon=True)
        collector.start()
        collector.join(timeout=6.0)
        lines.extend(list(others) or ["shardax watchdog: could not reach the coordinator to collect the other "
                                      "processes' reports"])
        lines.append(f"shardax watchdog: ending process {me} with exit code {EXIT_CODE} (set SHARDAX_WATCHDOG_S to "
                     "change the limit)")
        sys.stdout.flush()
        print("\n".join(lines), file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    @staticmethod
    def _collect(me: int, count: int, mine: str, out: list[str]) -> None:
        try:
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                return
            client.key_value_set(f"shardax/watchdog/{me}", mine)
            deadline = time.monotonic() + 5.0
            others = {p for p in range(count) if p != me}
            found = []
            while others and time.monotonic() < deadline:
                for p in sorted(others):
                    try:
                        got = client.key_value_try_get(f"shardax/watchdog/{p}")
                    except Exception:  # NOT_FOUND until that process posts
                        continue
                    if got:
                        found.append(f"shardax watchdog: {got}")
                        others.discard(p)
                time.sleep(0.2)
            found += [f"shardax watchdog: process {p}: no report (it is not in a watched call: running different "
                      "code, blocked outside shardax, or gone)" for p in sorted(others)]
            out.extend(found)
        except Exception as err:  # reporting must never stop the exit
            out.append(f"shardax watchdog: could not collect the other processes' reports ({err})")


_watchdog = _Watchdog()


def configure_watchdog(timeout_s: float | None) -> None:
    """Set the watchdog limit in seconds for one distributed call (``0`` disables, ``None`` restores the default).

    Example:
        >>> import shardax as sx
        >>> sx.runtime.configure_watchdog(600)
        >>> sx.runtime.configure_watchdog(None)
    """
    if timeout_s is not None and timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0 (0 disables the watchdog), got {timeout_s!r}")
    _watchdog.timeout_s = timeout_s


def watch(number: int, description: str, outputs: Any) -> None:
    """Watch the outputs of distributed call ``number``; the run ends with a report if they are not ready in time."""
    _watchdog.watch(number, description, outputs)


def release_finished() -> None:
    """Let go of the outputs of the watched calls that have finished (called before a new call is dispatched, so
    that XLA can reuse the memory of outputs the caller has dropped). Never blocks."""
    if _watchdog.queue:
        with _watchdog.cond:
            _watchdog._prune()
