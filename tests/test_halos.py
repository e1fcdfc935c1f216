"""``shardax halos``: the Gadget-4 catalogue from generated data and from a snapshot, checked against SciPy; the same
file at 1 process and at 2 processes x 4 devices; the compilation cache; bad arguments.

This module must not import conftest: the children of ``sx.testing.run_distributed`` import it by path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardax as sx
from shardax.cli._halos import _forward, generate, halos_parser, run_cli
from shardax.testing import reference

_CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE",
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


@pytest.fixture(autouse=True)
def _keep_cache_settings(monkeypatch):
    """The jobs switch JAX's persistent cache through the environment and jax.config: restore both afterwards."""
    import jax

    for name in _CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    enabled = jax.config.jax_enable_compilation_cache
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)


def _reference(pos: np.ndarray, linking_length: float, box: float, min_members: int) -> tuple[np.ndarray, np.ndarray]:
    """Group sizes in label order and the members in group order (then by index), from SciPy."""
    labels = reference.fof_labels(pos, linking_length, box=box, min_members=min_members)
    _, counts = np.unique(labels[labels >= 0], return_counts=True)
    members = np.flatnonzero(labels >= 0)
    return counts, members[np.lexsort((members, labels[members]))]


def test_generated(tmp_path, capsys) -> None:
    out = tmp_path / "gen"
    code = run_cli(["--particles", "6000", "--min-members", "10", "--seed", "3", "--out", str(out), "--no-cache"])
    assert code == 0
    text = capsys.readouterr().out
    assert "[4/4] mass function plot" in text and "largest halos" in text
    assert "friends-of-friends on 8 device(s)" in text and "compiled" in text
    table = sx.io.read_fof_table(out / "fof_tab_000.hdf5")
    assert (out / "mass_function.png").stat().st_size > 1000
    pos, _ = generate(6000, 1.0, 3)
    sizes, members = _reference(pos, 0.2 / 6000 ** (1 / 3), 1.0, 10)
    assert len(sizes) >= 5
    np.testing.assert_array_equal(table["Group"]["GroupLen"], sizes)
    np.testing.assert_array_equal(table["IDs"], members)
    assert table["Parameters"]["MinMembers"] == 10


def _snapshot(tmp_path, n: int = 4000, box: float = 20.0, seed: int = 5) -> tuple[str, np.ndarray]:
    pos, vel = generate(n, box, seed)
    snap = str(tmp_path / "snap.hdf5")
    sx.io.write_snapshot(snap, pos, box=box, vel=vel, mass=2.0)
    return snap, pos


def test_snapshot_absolute_linking_length(tmp_path, capsys) -> None:
    snap, pos = _snapshot(tmp_path)
    out = tmp_path / "snap_out"
    code = run_cli([snap, "--linking-length", "0.25", "--absolute", "--min-members", "8", "--out", str(out),
                    "--per-rank", "--redshift", "0.5", "--no-cache", "--particle-mass", "1e10"])
    assert code == 0
    text = capsys.readouterr().out
    assert f"snapshot {snap}" in text
    assert (out / "fof_tab_000.0.hdf5").exists() and not (out / "fof_tab_000.hdf5").exists()
    table = sx.io.read_fof_table(out / "fof_tab_000.hdf5")
    sizes, members = _reference(pos, 0.25, 20.0, 8)
    np.testing.assert_array_equal(table["Group"]["GroupLen"], sizes)
    np.testing.assert_array_equal(table["IDs"], members + 1)  # the snapshot's ParticleIDs are 1..N
    np.testing.assert_allclose(table["Group"]["GroupMass"], 2.0 * sizes)
    assert table["Header"]["Redshift"] == 0.5 and table["Header"]["BoxSize"] == 20.0


def test_forwarded_arguments_round_trip() -> None:
    ns = halos_parser().parse_args(["snap.hdf5", "--processes", "2", "--cpu-devices", "4", "--redshift", "1.5",
                                    "--particle-mass", "3e9", "--length-unit", "Mpc/h", "--per-rank", "--no-cache",
                                    "--plain", "--absolute", "--linking-length", "0.3"])
    again = halos_parser().parse_args(_forward(ns))
    assert {k: v for k, v in vars(again).items() if k not in ("processes", "timeout")} == \
        {k: v for k, v in vars(ns).items() if k not in ("processes", "timeout")}


def _fresh_process(code: str, home: Path) -> list[str]:
    """The words ``code`` prints in a new Python process, without this run's cache settings and with its per-user
    cache under ``home`` (the jobs' cache settings change the process they run in)."""
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_ENV}
    env["XDG_CACHE_HOME"] = str(home)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_cache_is_used_and_inherited(tmp_path) -> None:
    """The jobs' cache: a per-user directory that the launched processes inherit, filled by a compile."""
    code = ("import os, jax, jax.numpy as jnp\n"
            "from shardax._compile_cache import use_compilation_cache\n"
            "path = use_compilation_cache(True)\n"
            "jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(5.0)).block_until_ready()\n"
            "print(path, os.environ['JAX_COMPILATION_CACHE_DIR'], os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'],"
            " len(os.listdir(path)) > 0, use_compilation_cache(False), os.environ['JAX_ENABLE_COMPILATION_CACHE'])\n")
    want = str(tmp_path / "shardax" / "jax")
    assert _fresh_process(code, tmp_path) == [want, want, "0", "True", "None", "false"]


def test_cache_policy_after_initialize(tmp_path) -> None:
    """The jobs keep the cache on everywhere (with the same key for a program on every process, and loaded CPU
    programs of several devices checked for unordered collectives); CPU runs of several processes on one machine
    share their first compilations, other runs do not."""
    code = ("import jax, jax.numpy as jnp\n"
            "from types import SimpleNamespace as W\n"
            "from shardax._compile_cache import settle_compilation_cache, use_compilation_cache\n"
            "path = use_compilation_cache(True)\n"
            "jax.jit(lambda x: x + 1)(jnp.arange(3.0)).block_until_ready()\n"
            "got = []\n"
            "for w in (W(platform='gpu', device_count=8, num_processes=2, num_hosts=1), W(platform='cpu', "
            "device_count=1, num_processes=1, num_hosts=1), W(platform='cpu', device_count=8, num_processes=1, "
            "num_hosts=1), W(platform='cpu', device_count=8, num_processes=2, num_hosts=1), W(platform='cpu', "
            "device_count=8, num_processes=2, num_hosts=2)):\n"
            "    got += [settle_compilation_cache(w), jax.config.jax_share_binary_between_hosts]\n"
            "print(*got)\n")
    assert _fresh_process(code, tmp_path) == ["True", "False", "True", "False", "True", "False", "True", "True",
                                              "True", "False"]


def test_process_zero_hands_a_program_over_before_writing_it(tmp_path) -> None:
    """With the jobs' cache settings, JAX's share-and-cache step hands the executable to the other processes first
    and writes the cache entry after (held, not dropped); a write outside sharing is not held."""
    code = ("from jax._src import compiler\n"
            "events = []\n"
            "def share(*args, **kwargs):\n"
            "    compiler._cache_write('key', 1.0, 'm', None, 'exe', [])\n"
            "    events.append('shared')\n"
            "    return 'exe'\n"
            "share.modules_cache = {}\n"
            "compiler._compile_and_share_module = share\n"
            "compiler._cache_write = lambda *args, **kwargs: events.append('written-' + args[0])\n"
            "from shardax._compile_cache import use_compilation_cache\n"
            "use_compilation_cache(True)\n"
            "assert compiler._compile_and_share_module.modules_cache is share.modules_cache\n"
            "got = compiler._compile_and_share_module()\n"
            "compiler._cache_write('alone', 1.0, 'm', None, 'exe', [])\n"
            "print(got, *events, sep=',')\n")
    assert _fresh_process(code, tmp_path) == ["exe,shared,written-key,written-alone"]


@pytest.mark.parametrize("args, message", [
    (["--linking-length", "-1"], "--linking-length must be positive"),
    (["--min-members", "0"], "--min-members must be a positive integer"),
    (["--particle-mass", "0"], "--particle-mass must be positive"),
    (["no_such_snapshot.hdf5"], "does not exist"),
])
def test_bad_arguments(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_snapshot_file(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.hdf5"
    bad.write_bytes(b"\x89HDF\r\n" + b"0" * 100)
    assert run_cli([str(bad), "--out", str(tmp_path / "o"), "--no-cache"]) == 1
    assert "truncated or corrupt" in capsys.readouterr().err


def _two_layouts(snap: str, out: str) -> dict:
    """At 2 processes x 4 devices: the shared catalogue and the per-rank set of the same snapshot."""
    args = [snap, "--min-members", "10", "--no-cache", "--plain"]
    codes = [run_cli([*args, "--out", os.path.join(out, "shared")]),
             run_cli([*args, "--out", os.path.join(out, "ranked"), "--per-rank"])]
    return {"codes": codes, "world": (sx.world().num_processes, sx.world().device_count)}


def _same(a: dict, b: dict) -> None:
    for key in a["Header"]:
        if key not in ("NumFiles",):
            np.testing.assert_array_equal(a["Header"][key], b["Header"][key], err_msg=key)
    for name in a["Group"]:
        np.testing.assert_array_equal(a["Group"][name], b["Group"][name], err_msg=name)
    np.testing.assert_array_equal(a["IDs"], b["IDs"])


@pytest.mark.multiprocess
def test_same_catalogue_at_one_and_two_processes(tmp_path) -> None:
    snap, pos = _snapshot(tmp_path, 3000, 1.0, 8)
    assert run_cli([snap, "--min-members", "10", "--out", str(tmp_path / "one"), "--no-cache"]) == 0
    one = sx.io.read_fof_table(tmp_path / "one" / "fof_tab_000.hdf5")
    results = sx.testing.run_distributed(_two_layouts, snap, str(tmp_path), num_processes=2, cpu_devices=4)
    assert [r["world"] for r in results] == [(2, 8), (2, 8)] and all(r["codes"] == [0, 0] for r in results)
    shared = sx.io.read_fof_table(tmp_path / "shared" / "fof_tab_000.hdf5")
    ranked_files = sorted(os.listdir(tmp_path / "ranked"))
    assert [f for f in ranked_files if f.endswith(".hdf5")] == ["fof_tab_000.0.hdf5", "fof_tab_000.1.hdf5"]
    ranked = sx.io.read_fof_table(tmp_path / "ranked" / "fof_tab_000.hdf5")
    sizes, members = _reference(pos, 0.2 / 3000 ** (1 / 3), 1.0, 10)
    np.testing.assert_array_equal(one["Group"]["GroupLen"], sizes)
    np.testing.assert_array_equal(one["IDs"], members + 1)
    _same(shared, one)
    _same(ranked, one)
    assert int(shared["Header"]["NumFiles"]) == 1 and int(ranked["Header"]["NumFiles"]) == 2


@pytest.mark.multiprocess
def test_cpu_programs_of_several_devices_are_shared_and_cached_when_ordered(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With the jobs' cache settings on 2 processes x 2 CPU devices: a program whose collectives are ordered by data
    is compiled once per run on the first run (process 0 hands it to process 1) and loaded from the cache on the
    second; a program with two unordered collectives is loaded too, but every process compiles it again itself (a
    read-back XLA:CPU executable could run them in different orders on different devices); a program whose key
    differs between the processes is compiled by each after a wait. Right results each time."""
    script = Path(__file__).parent / "scripts" / "cache_keys.py"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))
    # A program whose key differs between the processes (a constant of each process's own) is waited for in vain by
    # process 1, which then compiles it itself (after 3 s here): it gets its own constant, 1 per row.
    monkeypatch.setenv("JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS", "3000")
    # (run, process, program) -> (cache hits, programs this process compiled, total). On the first run process 1
    # finds a program of process 0's in the cache when it asks after process 0 has handed it over and written it
    # (a loaded machine): either way it never compiles the ordered program, and compiles the unordered one itself.
    either = (0, 1)
    want = {
        (0, 0, "ordered"): (0, 1, 65), (0, 1, "ordered"): (either, 0, 65), (0, 0, "unordered"): (0, 1, 65),
        (0, 1, "unordered"): (either, 1, 65), (0, 0, "per_process"): (0, 1, 60), (0, 1, "per_process"): (0, 1, 65),
        (1, 0, "ordered"): (1, 0, 65), (1, 1, "ordered"): (1, 0, 65), (1, 0, "unordered"): (1, 1, 65),
        (1, 1, "unordered"): (1, 1, 65), (1, 0, "per_process"): (1, 0, 60), (1, 1, "per_process"): (0, 1, 65)}
    for run in range(2):
        result = sx.testing.launch_script(str(script), "3.0", num_processes=2, cpu_devices=2, timeout_s=300)
        assert result.returncode == 0, result.output
        for (r, rank, name), (hits, compiled, total) in want.items():
            if r != run:
                continue
            line = next(line for line in result.output.splitlines() if f"process {rank} {name}:" in line)
            # 4 devices x 5 rows x 3 (all-reduce) + 5 (all-reduce of the max, or the process's constant)
            allowed = hits if isinstance(hits, tuple) else (hits,)
            assert any(f"hits {h} compiled {compiled} cached True total {total}.0" in line for h in allowed), \
                (run, line)
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
