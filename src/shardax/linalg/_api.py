"""Global ``sx.linalg`` functions: layout conversion around the local-view kernels, over ``sx.smap``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core import smap
from ._checks import (
    apply_in_specs,
    check_flag,
    check_grid,
    check_matrix,
    check_rhs,
    check_tile,
    computing_mesh,
    computing_on,
    enter,
    explicit_avals,
    onto,
    resolve_mesh,
    under_auto_axes,
)
from ._layout import BlockCyclic, LinalgTuning, cyclic_spec, from_cyclic, grid_mesh, linalg_tuning, to_cyclic
from ._potrf import potrf_local
from ._potrs import solve_local
from ._solve import inverse_local
from ._syevd import jacobi_eigh_local, tridiagonal_eigh_local, tridiagonal_layout

TuningName = Literal["cpu", "gpu"]


def _constrain(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


# XLA's SPMD partitioner cannot go straight between the block-cyclic columns and a user layout such as rows
# P("x", None) or P("x", "y") of a 2D mesh: it gathers the whole matrix on every device first ("involuntary full
# rematerialization", N^2 words of memory per device). Through the natural-order columns over every device (and,
# for rows, the rows over every device) each stage is one all-to-all or all-gather.


def _from_user(a: jax.Array, mesh: Mesh) -> jax.Array:
    """``a`` as natural-order columns over every device of ``mesh``, ready for ``to_cyclic``."""
    return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, PartitionSpec(None, tuple(mesh.axis_names))))


def _to_user(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    """``x`` from ``from_cyclic`` in ``sharding``, by stages (see above)."""
    if sharding is None:
        return x
    axes = tuple(sharding.mesh.axis_names)
    x = jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, PartitionSpec(None, axes)))
    spec = (*sharding.spec, None, None)
    if spec[0] is not None and spec[1] is None:
        x = jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, PartitionSpec(axes, None)))
    return jax.lax.with_sharding_constraint(x, sharding)


def _spec(x: Any) -> PartitionSpec:
    return jax.typeof(x).sharding.spec


def _reshard(x: Any, sharding: NamedSharding | None) -> Any:
    """``x`` with exactly ``sharding`` (jit may return an equivalent one, e.g. on a one-device mesh)."""
    if x is None or sharding is None or isinstance(x, Tracer) or x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


@functools.lru_cache(maxsize=64)
def _solver(mesh: Mesh, layout: BlockCyclic, with_logdet: bool, b_sharding: NamedSharding | None):
    grid = grid_mesh(mesh, layout)
    local = smap(lambda a, b: solve_local(a, b, layout, with_logdet),
                 in_specs=(cyclic_spec(grid), PartitionSpec()),
                 out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec()), mesh=grid, expand=False)

    @jax.jit
    def run(a, b):
        rhs = b if b.ndim == 2 else b[:, None]
        rhs = jnp.pad(rhs, ((0, layout.padded - layout.n), (0, 0)))
        x, logdet, info = local(to_cyclic(_from_user(a, mesh), layout), rhs)
        x = x[: layout.n] if b.ndim == 2 else x[: layout.n, 0]
        return _constrain(x, b_sharding), logdet, info

    return run


@functools.lru_cache(maxsize=64)
def _factor(mesh: Mesh, layout: BlockCyclic, inverse: bool, a_sharding: NamedSharding | None):
    grid = grid_mesh(mesh, layout)

    def body(a):
        factor, info = potrf_local(a, layout)
        # The inverse's triangular solves run on the 1D columns, whatever the factorisation's grid.
        return (inverse_local(factor, layout.columns()) if inverse else factor), info

    local = smap(body, in_specs=(cyclic_spec(grid),), out_specs=(cyclic_spec(grid), PartitionSpec()), mesh=grid,
                 expand=False)

    @jax.jit
    def run(a):
        out, info = local(to_cyclic(_from_user(a, mesh), layout))
        return _to_user(from_cyclic(out, layout), a_sharding), info

    return run


def potrs(a: Any, b: Any, T_A: int | None = None, mesh: Mesh | None = None, in_specs: Any = None, *,
          tile: int | None = None, return_status: bool = False, return_logdet: bool = False,
          grid: tuple[int, int] | None = None, tuning: LinalgTuning | TuningName | None = None) -> Any:
    """Solve ``a x = b`` for a Hermitian positive definite ``a`` by a distributed blocked Cholesky factorisation.

    ``a`` may be sharded by rows ``P(r, None)``, columns ``P(None, c)`` or both ``P(r, c)`` over any mesh; it is
    redistributed to a block-cyclic layout over every device of the mesh (``tile`` columns per block, padded
    internally for any ``N``): 1D columns by default, or a 2D ``rows x cols`` process grid with ``grid`` (ScaLAPACK's
    layout: less communication per device on many devices). It is factored there and solved by distributed
    triangular solves on the 1D columns. Only the lower triangle of ``a`` is read (LAPACK's convention).
    Differentiable in ``a`` and ``b`` (custom VJP; with ``return_logdet`` the log-determinant too).

    Also accepts jaxmg's call ``potrs(a, b, T_A, mesh, in_specs)``: ``T_A`` is the tile, ``in_specs = (spec_a,
    spec_b)`` places host arrays; arrays that already carry a sharding keep it, and specs naming axes the mesh does
    not have (jaxmg's placeholder ``"T"``) are ignored.

    Args:
        a: `(N, N)` Hermitian positive definite, float32/float64/complex64/complex128.
        b: `(N,)` or `(N, K)` right-hand sides, ``a``'s dtype.
        T_A: jaxmg's name for ``tile``.
        mesh: the mesh; default the mesh ``a`` is sharded on, else the context mesh, else ``sx.flat_mesh()``.
            Explicit axes (``jax.make_mesh``'s default) are fine: the work runs on the same devices with automatic
            axes, and the results come back in the inputs' shardings (inside ``jit`` under ``jax.set_mesh`` of
            such a mesh, through ``jax.sharding.auto_axes``).
        in_specs: jaxmg's ``(spec_a, spec_b)``.
        tile: block size (default from ``tuning``: 256 on CPU and 512 on GPU, halved down to 64 / 128 while ``N``
            leaves fewer than 16 / 8 blocks per device; reduced for small ``N`` so that padding stays below a block
            per device).
        return_status: also return the LAPACK ``info``: 0, or ``k > 0`` when the leading minor of order ``k`` is
            not positive definite (``x`` and ``logdet`` are then NaN).
        return_logdet: also return ``log det a`` (real).
        grid: ``None`` (the 1D column layout) or ``(rows, cols)`` with ``rows * cols`` the mesh's device count: the
            2D process grid of the factorisation, the mesh's devices in row-major order (whatever the mesh's
            shape). See docs/linalg.md for when it pays.
        tuning: the default block sizes when ``tile`` is not given: ``None`` for the backend's preset
            (``SHARDAX_TUNING`` overrides), ``"cpu"``, ``"gpu"`` or a ``LinalgTuning``.

    Returns:
        ``x`` (``b``'s shape and sharding), then ``logdet`` if asked, then ``status`` if asked (jaxmg's order).

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> a = 2.0 * jnp.eye(5) + 0.1
        >>> x, logdet, status = sx.linalg.potrs(a, jnp.ones(5), tile=2, return_logdet=True, return_status=True)
        >>> bool(jnp.allclose(a @ x, 1.0, atol=1e-5)), int(status)
        (True, 0)
    """
    check_flag(return_status, "return_status")
    check_flag(return_logdet, "return_logdet")
    size = check_tile(tile, T_A)
    check_matrix(a)
    check_rhs(b, a)
    if explicit_avals(a, b):  # inside jit under an explicit context mesh
        specs = (_spec(b),) + ((PartitionSpec(),) if return_logdet else ()) + ((PartitionSpec(),) if return_status
                                                                                else ())
        return under_auto_axes(lambda a, b: potrs(a, b, T_A, mesh, in_specs, tile=tile, return_status=return_status,
                                                  return_logdet=return_logdet, grid=grid, tuning=tuning), (a, b),
                               specs[0] if len(specs) == 1 else specs)
    user_mesh = resolve_mesh(mesh, a)
    a, b = apply_in_specs(a, b, user_mesh, in_specs)
    the_mesh = computing_mesh(user_mesh)
    a = onto(a, the_mesh)
    b, b_sharding, b_back = enter(b, user_mesh, the_mesh)
    layout = BlockCyclic.create(a.shape[0], size, the_mesh.size, check_grid(grid, the_mesh.size), tuning,
                                the_mesh.devices, a.dtype)
    with computing_on(grid_mesh(the_mesh, layout), user_mesh):
        x, logdet, info = _solver(the_mesh, layout, return_logdet, b_sharding)(a, b)
    x = _reshard(x, b_back)
    out: tuple = (x,) + ((logdet,) if return_logdet else ()) + ((info,) if return_status else ())
    return out[0] if len(out) == 1 else out


def potrf(a: Any, *, tile: int | None = None, mesh: Mesh | None = None, return_status: bool = False,
          grid: tuple[int, int] | None = None, tuning: LinalgTuning | TuningName | None = None) -> Any:
    """Lower Cholesky factor ``L`` (``a = L L^H``) of a Hermitian positive definite ``a``, distributed.

    Blocked left-looking factorisation on a 1D block-cyclic column layout, or a 2D process grid with ``grid`` (see
    ``potrs``); only the lower triangle of ``a`` is read.

    Args:
        a: `(N, N)` Hermitian positive definite, sharded by rows, columns or both over any mesh.
        tile: block size (default as for ``potrs``).
        mesh: as in ``potrs``.
        return_status: also return the LAPACK ``info`` (``L`` is all NaN when it is positive).
        grid: as in ``potrs``.
        tuning: as in ``potrs``.

    Returns:
        `L: (N, N)` lower triangular with ``a``'s sharding, then ``status`` if asked.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> a = jnp.array([[4.0, 2.0], [2.0, 5.0]])
        >>> sx.linalg.potrf(a).tolist()
        [[2.0, 0.0], [1.0, 2.0]]
    """
    return _factor_api(a, tile, mesh, return_status, grid, tuning, inverse=False)


def potri(a: Any, *, tile: int | None = None, mesh: Mesh | None = None, return_status: bool = False,
          grid: tuple[int, int] | None = None, tuning: LinalgTuning | TuningName | None = None) -> Any:
    """Inverse of a Hermitian positive definite ``a`` through its distributed Cholesky factor.

    ``a^{-1} = L^{-H} L^{-1}`` by two distributed triangular solves with the identity's columns, each device on its
    own columns of the 1D layout: ``W = L^{-1}`` (about ``N^3 / (3P)`` flops per device), then ``L^{-H} W`` (about
    ``N^3 / P``).

    Args:
        a: `(N, N)` Hermitian positive definite, sharded by rows, columns or both over any mesh.
        tile: block size (default as for ``potrs``).
        mesh: as in ``potrs``.
        return_status: also return the LAPACK ``info`` (the inverse is all NaN when it is positive).
        grid: as in ``potrs``: the factorisation's process grid (the inverse is formed on the 1D columns).
        tuning: as in ``potrs``.

    Returns:
        `(N, N)` the inverse with ``a``'s sharding, then ``status`` if asked.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> inverse = sx.linalg.potri(jnp.array([[4.0, 0.0], [0.0, 2.0]]))
        >>> [[round(float(v), 5) for v in row] for row in inverse]
        [[0.25, 0.0], [0.0, 0.5]]
    """
    return _factor_api(a, tile, mesh, return_status, grid, tuning, inverse=True)


def _factor_api(a: Any, tile: int | None, mesh: Mesh | None, return_status: bool, grid: Any, tuning: Any, *,
                inverse: bool) -> Any:
    check_flag(return_status, "return_status")
    size = check_tile(tile)
    check_matrix(a)
    if explicit_avals(a):  # inside jit under an explicit context mesh
        return under_auto_axes(lambda a: _factor_api(a, tile, mesh, return_status, grid, tuning, inverse=inverse),
                               (a,), (_spec(a), PartitionSpec()) if return_status else _spec(a))
    user_mesh = resolve_mesh(mesh, a)
    the_mesh = computing_mesh(user_mesh)
    a, a_sharding, a_back = enter(a, user_mesh, the_mesh)
    layout = BlockCyclic.create(a.shape[0], size, the_mesh.size, check_grid(grid, the_mesh.size), tuning,
                                the_mesh.devices, a.dtype)
    with computing_on(grid_mesh(the_mesh, layout), user_mesh):
        out, info = _factor(the_mesh, layout, inverse, a_sharding)(a)
    out = _reshard(out, a_back)
    return (out, info) if return_status else out


def _prepare_hermitian(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Hermitian matrix of ``a``'s lower triangle, scaled by a power of two to largest entry ~1 (exact), as
    LAPACK's syevd does (sums of squares then neither overflow nor underflow), with non-finite input replaced by 0.

    Returns:
        ``(herm, exponent, finite)``: `herm: (N, N)`, the scale exponent and whether ``a``'s lower triangle is finite.
    """
    lower = jnp.tril(a, -1)
    herm = lower + jnp.conj(lower).T + jnp.diag(jnp.real(jnp.diagonal(a)).astype(a.dtype))
    finite = jnp.all(jnp.isfinite(herm))
    herm = jnp.where(finite, herm, jnp.zeros_like(herm))
    real = jnp.finfo(a.dtype).dtype
    info = jnp.finfo(real)
    _, exponent = jnp.frexp(jnp.max(jnp.abs(herm)))
    exponent = jnp.clip(exponent, -(info.maxexp - 1), -info.minexp)
    return herm * jnp.ldexp(jnp.ones((), real), -exponent).astype(a.dtype), exponent, finite


def _pad_above_spectrum(herm: jax.Array, npad: int) -> jax.Array:
    """``herm`` padded to ``(npad, npad)``; the padding's eigenvalues sit above the Gershgorin bound of the spectrum,
    so they sort last and never mix with the data."""
    n = herm.shape[0]
    bound = jnp.max(jnp.sum(jnp.abs(herm), axis=0))
    herm = jnp.pad(herm, ((0, npad - n), (0, npad - n)))
    if npad > n:
        idx = jnp.arange(n, npad, dtype=jnp.int32)
        herm = herm.at[idx, idx].set((2 * bound + 1).astype(herm.dtype))
    return herm


@functools.lru_cache(maxsize=64)
def _eigensolver(mesh: Mesh, n: int, method: str, max_sweeps: int, tile: int, vectors: bool,
                 a_sharding: NamedSharding | None):
    axes = tuple(mesh.axis_names)
    columns = PartitionSpec(None, axes)
    local: Callable[[jax.Array], tuple[jax.Array, jax.Array | None, jax.Array]]
    if mesh.size == 1:
        def one_device(herm):
            w, v = jnp.linalg.eigh(herm, symmetrize_input=False)
            return w, (v if vectors else None), jnp.ones((), bool)
        local = one_device
        npad = n
    elif method == "jacobi":
        block = -(-n // (2 * mesh.size))
        npad = 2 * block * mesh.size
        jacobi = smap(lambda m: jacobi_eigh_local(m, max_sweeps), in_specs=(columns,),
                      out_specs=(PartitionSpec(axes), columns, PartitionSpec(), PartitionSpec()), mesh=mesh,
                      expand=False)

        def by_jacobi(herm):
            w, v, _, converged = jacobi(herm)
            return w, v, converged
        local = by_jacobi
    else:
        layout = tridiagonal_layout(n, mesh.size, tile)
        npad = layout.padded
        full = BlockCyclic(npad, layout.tile, layout.nproc)
        out = (PartitionSpec(axes), columns) if vectors else PartitionSpec(axes)

        def body(m):
            w, v, _ = tridiagonal_eigh_local(m, layout, vectors)
            return (w, v) if vectors else w

        tridiagonal = smap(body, in_specs=(columns,), out_specs=out, mesh=mesh, expand=False)

        def by_tridiagonal(herm):
            result = tridiagonal(to_cyclic(herm, full))
            w, v = result if vectors else (result, None)
            return w, v, jnp.ones((), bool)
        local = by_tridiagonal

    @jax.jit
    def run(a):
        herm, exponent, finite = _prepare_hermitian(a)
        w, v, converged = local(_pad_above_spectrum(herm, npad))
        ok = converged & finite
        order = jnp.argsort(w)[:n]
        w = jnp.where(ok, jnp.ldexp(w[order], exponent), jnp.nan)
        status = jnp.where(ok, 0, 1).astype(jnp.int32)
        if v is None:
            return w, None, status
        v = jnp.where(ok, v[:n][:, order], jnp.nan)
        return w, _constrain(v, a_sharding), status

    return run


def syevd(a: Any, *, tile: int | None = None, mesh: Mesh | None = None, return_eigenvectors: bool = True,
          return_status: bool = False, tuning: LinalgTuning | TuningName | None = None, max_sweeps: int = 30,
          method: str = "tridiagonal") -> Any:
    """Eigenvalues (ascending) and eigenvectors of a Hermitian ``a``, distributed.

    Default (``method="tridiagonal"``): blocked Householder reduction to a real tridiagonal ``T`` on the block-cyclic
    column layout (``tile`` columns per block and reflector panel; one all-reduce per column, BLAS3 trailing
    updates), eigenvalues of ``T`` by Sturm multisection and eigenvectors by inverse iteration, both distributed by
    eigenvalue (reorthogonalised inside clusters of close eigenvalues; a cluster longer than 32 takes a local dense
    ``eigh`` of ``T``), then the back-transformation by compact-WY panels, distributed by eigenvector.
    ``method="jacobi"``: two-sided block Jacobi with a round-robin tournament, swept until the off-diagonal norm is
    below ``eps sqrt(N) ||A||_F``. On one device either is a single local ``eigh``. Only the lower triangle of ``a``
    is read.

    The options are those of ``potrf`` except ``grid``: the reduction is written for the 1D block-cyclic
    columns (every device holds whole columns, so ``y = A v`` is one product and one all-reduce per column); it has
    no 2D process-grid form.

    Args:
        a: `(N, N)` Hermitian, sharded by rows, columns or both over any mesh.
        tile: block size of the reduction's block-cyclic layout, which is also its reflector panel width (default
            from ``tuning``: 32, as LAPACK's ``sytrd``; reduced for small ``N`` so that padding stays below a block
            per device). Larger panels make the trailing updates larger products and the per-column panel updates
            longer. Used by the default method on several devices; validated and ignored by ``method="jacobi"``
            (whose blocks are ``N / (2P)`` columns, two per device) and on one device (LAPACK's ``eigh``).
        mesh: as in ``potrs``.
        return_eigenvectors: also return the eigenvectors.
        return_status: also return the status: 0, or 1 (outputs then NaN) when the lower triangle of ``a`` has a
            non-finite entry or, with ``method="jacobi"``, Jacobi did not converge in ``max_sweeps`` sweeps (as
            LAPACK's ``info > 0``).
        tuning: the default ``tile`` when it is not given (``LinalgTuning``'s ``reduction_tile``): ``None``
            for the backend's preset (``SHARDAX_TUNING`` overrides), ``"cpu"``, ``"gpu"`` or a
            ``LinalgTuning``.
        max_sweeps: the most Jacobi sweeps (``method="jacobi"`` only; validated and ignored otherwise).
        method: ``"tridiagonal"`` (default) or ``"jacobi"``.

    Returns:
        `w: (N,)` ascending, replicated; then `v: (N, N)` (columns are eigenvectors, ``a``'s sharding) if asked;
        then ``status`` if asked.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> w, v = sx.linalg.syevd(jnp.array([[2.0, 1.0], [1.0, 2.0]]), tile=16)
        >>> [round(float(x), 5) for x in w]
        [1.0, 3.0]
    """
    check_flag(return_eigenvectors, "return_eigenvectors")
    check_flag(return_status, "return_status")
    size = check_tile(tile, suggest=LinalgTuning().reduction_tile)
    if not isinstance(max_sweeps, int) or isinstance(max_sweeps, bool) or max_sweeps < 1:
        raise ValueError(f"max_sweeps must be a positive int, got {max_sweeps!r}")
    check_matrix(a)
    if method not in ("tridiagonal", "jacobi"):
        raise ValueError(f"method must be 'tridiagonal' or 'jacobi', got {method!r}")
    if explicit_avals(a):  # inside jit under an explicit context mesh
        specs = (PartitionSpec(),) + ((_spec(a),) if return_eigenvectors else ()) + ((PartitionSpec(),)
                                                                                     if return_status else ())
        return under_auto_axes(lambda a: syevd(a, tile=tile, mesh=mesh, return_eigenvectors=return_eigenvectors,
                                               return_status=return_status, tuning=tuning, max_sweeps=max_sweeps,
                                               method=method),
                               (a,), specs[0] if len(specs) == 1 else specs)
    user_mesh = resolve_mesh(mesh, a)
    the_mesh = computing_mesh(user_mesh)
    a, a_sharding, a_back = enter(a, user_mesh, the_mesh)
    reduction_tile = linalg_tuning(tuning, the_mesh.devices).reduction_tile if size is None else size
    # One compiled program whatever the value of an option the method ignores.
    sweeps = max_sweeps if method == "jacobi" else 0
    used_tile = reduction_tile if method == "tridiagonal" and the_mesh.size > 1 else 0
    with computing_on(the_mesh, user_mesh):
        w, v, status = _eigensolver(the_mesh, a.shape[0], method, sweeps, used_tile, return_eigenvectors,
                                    a_sharding)(a)
    v = _reshard(v, a_back)
    out: tuple = (w,) + ((v,) if return_eigenvectors else ()) + ((status,) if return_status else ())
    return out[0] if len(out) == 1 else out
