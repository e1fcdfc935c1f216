"""Runtime: launch detection, world, device grid, meshes, host replication, initialize errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.runtime import _env


def test_detect_single_process_by_default():
    info = _env.detect({})
    assert (info.num_processes, info.process_id, info.source, info.coordinator_address) == (1, 0, "single", None)


def test_detect_launcher_environment():
    env = {_env.ENV_COORDINATOR: "127.0.0.1:5000", _env.ENV_NUM_PROCESSES: "2", _env.ENV_PROCESS_ID: "1",
           _env.ENV_CPU_DEVICES: "4", "SLURM_JOB_ID": "7"}
    info = _env.detect(env)
    assert info == _env.LaunchInfo("127.0.0.1:5000", 2, 1, "shardax-launch", 4)
    with pytest.raises(ValueError, match="SHARDAX_COORDINATOR_ADDRESS"):
        _env.detect({_env.ENV_NUM_PROCESSES: "2", _env.ENV_PROCESS_ID: "0"})
    with pytest.raises(ValueError, match="is not an integer"):
        _env.detect({**env, _env.ENV_PROCESS_ID: "one"})


def test_detect_slurm():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
           "SLURM_STEP_NODELIST": "node[007-009,011],gpu01", "SLURM_STEP_ID": "0"}
    info = _env.detect(env)
    assert info.source == "slurm" and info.num_processes == 4 and info.process_id == 3
    host, port = info.coordinator_address.split(":")
    assert host == "node007" and 61440 <= int(port) < 65536
    assert _env.detect({**env, "SLURM_PROCID": "0"}).coordinator_address == info.coordinator_address
    assert _env.detect({**env, "SLURM_STEP_NUM_TASKS": "1"}).num_processes == 1
    assert _env._first_slurm_host("login1") == "login1"


def test_detect_openmpi4_and_5():
    env4 = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
            "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    info = _env.detect(env4)
    assert info.source == "openmpi4" and info.coordinator_address.startswith("10.96.0.1:")
    assert (info.num_processes, info.process_id) == (2, 1)
    env5 = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "PMIX_NAMESPACE": "prterun-head-node-12345@1", "PMIX_RANK": "2"}
    info = _env.detect(env5)
    assert info.source == "openmpi5" and info.coordinator_address.startswith("127.0.0.1:")
    assert (info.num_processes, info.process_id) == (4, 2)
    multi = _env.detect({**env5, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert multi.coordinator_address.startswith("head-node:")
    assert multi.coordinator_address == _env.detect({**env5, "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                                     "OMPI_COMM_WORLD_RANK": "0"}).coordinator_address
    with pytest.raises(ValueError, match="SHARDAX_COORDINATOR_ADDRESS"):
        _env.detect({**env5, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "weird"})


def test_detect_mpich_hydra(monkeypatch: pytest.MonkeyPatch):
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "9", "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1"}
    assert _env.detect(env) == _env.LaunchInfo(None, 2, 1, "hydra")  # rank 0's address: agreed through MPI
    assert _env.detect({**env, _env.ENV_COORDINATOR: "node3:7000"}).coordinator_address == "node3:7000"
    assert _env.detect({**env, "PMI_SIZE": "1", "PMI_RANK": "0"}).num_processes == 1
    assert _env.detect({**env, "SLURM_JOB_ID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
                        "SLURM_STEP_NODELIST": "n1"}).source == "slurm"  # srun --mpi=pmi2 sets PMI_RANK too
    # Without an MPI to agree through, the run is refused with the fix, never run as separate single processes.
    from shardax.runtime import _initialize

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(sx.DistributedSetupError, match=r"hydra: rank 1 of 2.*SHARDAX_COORDINATOR_ADDRESS"):
        _initialize._coordinator_through_mpi(_env.detect(env))


def test_world_and_grid_in_one_process():
    w = sx.initialize()
    assert w == sx.world()
    assert (w.process_id, w.num_processes, w.local_device_count, w.device_count) == (0, 1, 8, 8)
    assert w.mode == "single" and w.num_hosts == 1 and w.platform == "cpu"
    grid = sx.device_grid()
    assert grid.shape == (1, 8)
    assert [d.id for d in grid[0]] == sorted(d.id for d in jax.devices())
    assert sx.flat_mesh().axis_names == ("d",) and sx.flat_mesh().devices.shape == (8,)
    mesh = sx.grid_mesh()
    assert mesh.axis_names == ("hosts", "d") and mesh.devices.shape == (1, 8)
    with pytest.raises(ValueError, match="two distinct str names"):
        sx.grid_mesh(("a", "a"))
    with pytest.raises(TypeError, match="axis_name must be a str"):
        sx.flat_mesh(3)  # type: ignore[arg-type]


def test_initialize_rejects_inconsistent_arguments():
    with pytest.raises(ValueError, match="pass coordinator_address, num_processes and process_id together"):
        sx.initialize("127.0.0.1:1234", 2)
    with pytest.raises(ValueError, match="cpu_devices must be a positive int"):
        sx.initialize(cpu_devices=0)
    with pytest.raises(sx.DistributedSetupError, match="already started with 8 CPU device"):
        sx.initialize(cpu_devices=3)
    with pytest.raises(sx.DistributedSetupError, match="already called as process 0 of 1"):
        sx.initialize("127.0.0.1:1", 2, 1)


def test_initialize_after_backend_started_names_the_fix():
    code = textwrap.dedent("""
        import jax, shardax as sx
        jax.devices()
        try:
            sx.initialize("127.0.0.1:1", 2, 0)
        except sx.DistributedSetupError as e:
            print("ERR", e)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert "ERR" in out.stdout and "call sx.initialize() first" in out.stdout, out.stdout + out.stderr


def test_import_changes_no_config_and_starts_no_backend():
    code = textwrap.dedent("""
        import jax
        before = {k: getattr(jax.config, k) for k in ("jax_enable_x64", "jax_num_cpu_devices",
                                                      "jax_cpu_collectives_implementation")}
        import shardax
        from jax._src import xla_bridge
        after = {k: getattr(jax.config, k) for k in before}
        assert before == after, (before, after)
        assert not xla_bridge.backends_are_initialized()
        print("OK")
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "OK", out.stdout + out.stderr


def test_a_process_waits_for_the_coordinator_to_listen_before_it_joins():
    # (JAX's client, refused by a coordinator not yet listening, would wait a whole second before asking again.)
    import socket
    import threading
    import time

    from shardax.runtime._initialize import _await_coordinator

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert 0.1 <= _await_coordinator(f"127.0.0.1:{port}", 0.1) < 1.0  # nobody listens: gives up after the timeout
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        waited = _await_coordinator(f"127.0.0.1:{port}", 30.0)
    finally:
        thread.join()
        server.close()
    assert 0.25 <= waited < 2.0  # joined within a few milliseconds of the port opening, not after a backoff
    assert _await_coordinator("no-port-here", 30.0) == 0.0


def test_initialize_cpu_devices_in_fresh_process():
    code = "import shardax as sx; w = sx.initialize(cpu_devices=3); print(w.local_device_count, w.mode)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "3 single", out.stdout + out.stderr


def test_host_replicate_jaxmg_layout():
    mesh = sx.grid_mesh(("x", "y"))
    a = jax.device_put(jnp.diag(jnp.arange(1, 9, dtype=jnp.float32)), NamedSharding(mesh, P(None, ("x", "y"))))
    out = sx.host_replicate(a, mesh, axis="x")
    assert out.sharding.spec == P(None, "y")
    np.testing.assert_array_equal(np.asarray(out), np.diag(np.arange(1, 9, dtype=np.float32)))
    with pytest.raises(ValueError, match="axis='hosts' is not an axis of the mesh"):
        sx.host_replicate(a, mesh)
    with pytest.raises(TypeError, match="NamedSharding"):
        sx.host_replicate(np.zeros(3), mesh, axis="x")  # type: ignore[arg-type]
    inside = jax.jit(lambda b: sx.host_replicate(b, mesh, axis="x") * 2)(a)
    np.testing.assert_array_equal(np.asarray(inside), 2 * np.asarray(a))
