"""glibc's allocator set up for XLA:CPU (``shardax.runtime._malloc``): the environment shardax gives the processes
it starts, the restart of commands that compute in their own process, and the effect: no page faulted anew per call."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from shardax.runtime import child_env
from shardax.runtime._malloc import MALLOC_ENV, malloc_env

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")

# Calls FoF (one device, 200,000 points: buffers of megabytes) and counts the page faults of each call: XLA:CPU
# allocates a program's buffers on every call.
_FAULTS = """
import json, os, resource
import jax, numpy as np
from shardax.particles import Particles
from shardax.spatial._fof import fof
n = 200_000
pos = np.random.default_rng(0).random((n, 3), dtype=np.float32)
part = Particles(pos=jax.numpy.asarray(pos), num=jax.numpy.int32(n))
f = jax.jit(lambda p: fof(p, 0.2 / n ** (1 / 3), box=1.0, min_members=2).labels)
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(part).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"arena_max": os.environ.get("MALLOC_ARENA_MAX"), "faults": faults}))
"""



@glibc
def test_malloc_env_defaults_and_opt_outs():
    assert malloc_env({}) == MALLOC_ENV
    assert malloc_env({"SHARDAX_MALLOC": "tuned"}) == MALLOC_ENV
    assert malloc_env({"SHARDAX_MALLOC": "system"}) == {}
    # A user's own glibc settings win: none of ours is added next to them.
    assert malloc_env({"MALLOC_ARENA_MAX": "4"}) == {}
    assert malloc_env({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}) == {}  # an allocator tunable of yours
    # Other tunables of yours stay, ahead of the allocator's.
    assert malloc_env({"GLIBC_TUNABLES": "glibc.cpu.x86_shstk=off"})["GLIBC_TUNABLES"] == \
        "glibc.cpu.x86_shstk=off:glibc.malloc.tcache_count=32"
    with pytest.raises(ValueError, match="SHARDAX_MALLOC must be 'tuned'"):
        malloc_env({"SHARDAX_MALLOC": "jemalloc"})


@glibc
def test_launched_processes_get_the_allocator_settings():
    env = child_env({"PATH": "/bin"}, process_id=1, num_processes=2, coordinator="127.0.0.1:1", cpu_devices=4)
    assert {k: env[k] for k in MALLOC_ENV} == MALLOC_ENV
    env = child_env({"SHARDAX_MALLOC": "system"}, process_id=1, num_processes=2, coordinator="127.0.0.1:1",
                    cpu_devices=None)
    assert not set(MALLOC_ENV) & set(env)
    mine = child_env({"MALLOC_ARENA_MAX": "2"}, process_id=0, num_processes=2, coordinator="127.0.0.1:1",
                     cpu_devices=None)
    assert mine["MALLOC_ARENA_MAX"] == "2" and "MALLOC_MMAP_MAX_" not in mine


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV and k != "SHARDAX_MALLOC"}
    env.update(extra, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    return env


@glibc
def test_restart_with_malloc_env_once_and_not_when_opted_out(tmp_path):
    script = tmp_path / "restart.py"
    script.write_text("import os, sys\nfrom shardax.runtime import restart_with_malloc_env\n"
                      "print('run', os.environ.get('MALLOC_ARENA_MAX'), sys.argv[1:], flush=True)\n"
                      "restart_with_malloc_env(sys.argv)\n")
    out = subprocess.run([sys.executable, str(script), "x"], env=_clean_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # Restarted once, with the settings and the same arguments.
    assert out.stdout.splitlines() == ["run None ['x']", "run 1 ['x']"]
    out = subprocess.run([sys.executable, str(script)], env=_clean_env(SHARDAX_MALLOC="system"),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "run None []"
    out = subprocess.run([sys.executable, "-m", "shardax.cli", "halos", "--particles", "1000"],
                         env=_clean_env(SHARDAX_MALLOC="bogus"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "SHARDAX_MALLOC must be 'tuned'" in out.stderr, out.stderr[-2000:]


# Records every Python process that starts (its allocator setting, and whether a launcher started it); the launched
# processes stop there.
_RECORD = """
import json, os
with open(os.environ["SHARDAX_TEST_RECORD"], "a") as f:
    f.write(json.dumps([os.environ.get("MALLOC_ARENA_MAX"), "SHARDAX_NUM_PROCESSES" in os.environ]) + "\\n")
if "SHARDAX_NUM_PROCESSES" in os.environ:
    os._exit(0)
"""


@glibc
def test_the_command_restarts_only_a_process_that_computes(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_RECORD)
    record = tmp_path / "started.jsonl"
    env = _clean_env(SHARDAX_TEST_RECORD=str(record), PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    script = "import sys; from shardax.cli import main; sys.argv[0] = 'shardax'; sys.exit(main())"

    def started(*args: str) -> list[list]:
        record.unlink(missing_ok=True)
        out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return [json.loads(line) for line in record.read_text().splitlines()]

    # Launching: the command starts its processes with the settings and does not start itself again.
    assert started("halos", "--particles", "100", "--processes", "2", "--no-cache",
                   "--out", str(tmp_path / "out")) == [[None, False], ["1", True], ["1", True]]
    assert started("nbody", "--help") == [[None, False]]


def _faults(**extra: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=_clean_env(**extra), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_allocator_settings_reuse_memory_between_calls():
    # glibc's defaults: every call maps its large buffers afresh (the kernel zeroes ~15,000 pages).
    system = _faults()
    assert system["arena_max"] is None
    assert min(system["faults"][2:]) > 5000, system
    # Started with the environment shardax gives its processes: once the heap holds the calls' working set, no
    # page is faulted anew.
    tuned = _faults(**MALLOC_ENV)
    assert tuned["arena_max"] == "1"
    assert sum(tuned["faults"][2:]) < 500, tuned
