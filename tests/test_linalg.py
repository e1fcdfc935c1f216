"""sx.linalg (potrf, potrs, potri, syevd) against NumPy/SciPy on 1, 4 and 8 devices, every input layout."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg as sl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import shardax as sx
from conftest import make_mesh
from shardax.linalg._layout import (
    COL,
    ROW,
    BlockCyclic,
    cyclic_spec,
    default_tile,
    from_cyclic,
    grid_mesh,
    to_columns_local,
    to_cyclic,
    to_grid_local,
)
from shardax.linalg._potrf import potrf_local
from shardax.linalg._potrs import solve_local
from shardax.linalg._syevd import jacobi_eigh_local, tridiagonal_eigh_local, tridiagonal_layout


def hpd(n: int, dtype, *, seed: int = 0, cond: float | None = None) -> np.ndarray:
    """A Hermitian positive definite matrix: well conditioned, or with eigenvalues spread over ``cond``."""
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((n, n))
    if np.dtype(dtype).kind == "c":
        m = m + 1j * rng.standard_normal((n, n))
    if cond is None:
        a = m @ m.conj().T / n + np.eye(n)
    else:
        q, _ = np.linalg.qr(m)
        a = (q * np.logspace(0, -np.log10(cond), n)) @ q.conj().T
        a = (a + a.conj().T) / 2
    return a.astype(dtype)


def rhs(n: int, k: int | None, dtype, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (n,) if k is None else (n, k)
    b = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        b = b + 1j * rng.standard_normal(shape)
    return b.astype(dtype)


def spec(layout: str, mesh) -> P:
    axes = tuple(mesh.axis_names)
    return {"rows": P(axes, None), "cols": P(None, axes), "2d": P(*axes), "replicated": P()}[layout]


def put(x: np.ndarray, mesh, layout: str) -> jax.Array:
    return jax.device_put(x, NamedSharding(mesh, spec(layout, mesh)))


def close(actual, desired, dtype, scale: float = 1.0) -> None:
    tol = sx.testing.tolerance(dtype, kind="linalg")
    np.testing.assert_allclose(np.asarray(actual), desired, rtol=scale * tol["rtol"], atol=scale * tol["atol"])


def check_eigh(a: np.ndarray, w, v, dtype) -> None:
    """Eigenvalues against LAPACK; eigenvectors by residual and orthogonality relative to the norm of ``a``
    (Jacobi's rotations accumulate rounding over sweeps x steps, so elementwise vector comparison is not stable)."""
    w, v = np.asarray(w), np.asarray(v)
    rtol = sx.testing.tolerance(dtype, kind="linalg")["rtol"]
    norm = np.linalg.norm(a, 2)
    assert np.max(np.abs(w - np.linalg.eigvalsh(a))) < 10 * rtol * norm
    assert np.all(np.diff(w) >= 0)
    assert np.linalg.norm(a @ v - v * w) < 10 * rtol * norm * np.sqrt(len(a))
    assert np.max(np.abs(v.conj().T @ v - np.eye(len(a)))) < 10 * rtol


def first_bad_minor(a: np.ndarray) -> int:
    """The order of the first leading minor that is not positive definite (0 if none), by bisection: a leading minor
    contains every smaller one, so once one fails all larger ones fail (N choleskys took minutes at N = 997)."""
    def positive(k: int) -> bool:
        try:
            np.linalg.cholesky(a[:k, :k])
        except np.linalg.LinAlgError:
            return False
        return True

    if positive(len(a)):
        return 0
    good, bad = 0, len(a)  # leading minor `good` is positive definite (0: empty), `bad` is not
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if positive(mid) else (good, mid)
    return bad


def test_potrs_every_mesh(mesh):
    n, dtype = 40, np.float32
    a, b = hpd(n, dtype), rhs(n, 2, dtype)
    bd = put(b, mesh, "rows")
    x, logdet, status = sx.linalg.potrs(put(a, mesh, "cols"), bd, tile=3, return_logdet=True, return_status=True)
    close(x, sl.cho_solve(sl.cho_factor(a), b), dtype)
    close(logdet, np.linalg.slogdet(a.astype(np.float64))[1], dtype)
    assert int(status) == 0
    assert x.sharding == bd.sharding


@pytest.mark.parametrize(("shape", "layout", "n", "tile"), [
    ((4,), "rows", 24, 1),
    ((4,), "cols", 1000, 256),
    ((2, 2), "2d", 60, 3),
    ((2, 4), "cols", 1000, 64),
    ((2, 4), "2d", 96, 256),
    ((2, 4), "replicated", 997, 256),
])
def test_potrs_layouts_and_tiles(shape, layout, n, tile):
    mesh = make_mesh(shape)
    a, b = hpd(n, np.float32, seed=n), rhs(n, 3, np.float32)
    x, status = sx.linalg.potrs(put(a, mesh, layout), jnp.asarray(b), tile=tile, return_status=True)
    close(x, sl.cho_solve(sl.cho_factor(a), b), np.float32)
    assert int(status) == 0


def test_default_tile():
    """256, halved down to 64 while that leaves fewer than 16 blocks per device (the benchmark sizes' choices)."""
    assert [default_tile(n, p) for n, p in [(4096, 1), (4095, 1), (4096, 4), (8192, 4), (16384, 4), (1000, 8)]] == [
        256, 128, 64, 128, 256, 64]
    assert BlockCyclic.create(4096, None, 4).tile == 64 and BlockCyclic.create(4096, 128, 4).tile == 128
    assert BlockCyclic.create(40, None, 4).tile == 10  # reduced for small N, as an explicit tile is
    mesh = make_mesh((4,))
    a, b = hpd(40, np.float32, seed=40), rhs(40, 2, np.float32)
    close(sx.linalg.potrs(put(a, mesh, "cols"), jnp.asarray(b)), sl.cho_solve(sl.cho_factor(a), b), np.float32)
    close(sx.linalg.potrf(put(a, mesh, "rows")), np.linalg.cholesky(a), np.float32)


@pytest.mark.parametrize("shape", [(1,), (8,), (2, 4)])
def test_potrf_potri(shape):
    mesh = make_mesh(shape)
    a = hpd(48, np.float32, seed=3)
    ad = put(a, mesh, "rows")
    factor, status = sx.linalg.potrf(ad, tile=5, return_status=True)
    close(factor, np.linalg.cholesky(a), np.float32)
    assert int(status) == 0 and factor.sharding == ad.sharding
    inverse = sx.linalg.potri(ad, tile=5)
    close(inverse, np.linalg.inv(a), np.float32, scale=3.0)
    assert inverse.sharding == ad.sharding


@pytest.mark.parametrize(("shape", "tile"), [((1,), 3), ((4,), 4), ((2, 4), 3)])
def test_potrf_phases_across_local_blocks(shape, tile):
    """More steps than phases (16), with phase bounds that do not fall on local-block bounds (N = 200, tile 4 on 4
    devices: 52 steps, phases of 3-4 steps such as steps 3-5, which start one device's second local block while
    another factors its first): the factor and the inverse match LAPACK's, and a failing minor in a late phase, on
    any device, gives its ``info``."""
    mesh = make_mesh(shape)
    n = 200
    layout = BlockCyclic.create(n, tile, mesh.size)
    assert layout.blocks > 16 and layout.blocks % 16 != 0
    a = hpd(n, np.float32, seed=21)
    factor, status = sx.linalg.potrf(put(a, mesh, "cols"), tile=tile, return_status=True)  # (one program: as below)
    close(factor, np.linalg.cholesky(a), np.float32)
    assert int(status) == 0
    close(sx.linalg.potri(put(a, mesh, "cols"), tile=tile), np.linalg.inv(a), np.float32, scale=3.0)
    for bad in (27, 151, 200):
        broken = a.copy()
        broken[bad - 1, bad - 1] = -1.0
        factor, status = sx.linalg.potrf(put(broken, mesh, "cols"), tile=tile, return_status=True)
        assert int(status) == first_bad_minor(broken) == bad
        assert np.isnan(np.asarray(factor)).all()


@pytest.mark.parametrize(("shape", "grid", "layout", "n", "tile"), [
    ((4,), (2, 2), "rows", 52, 3),
    ((2, 4), (2, 4), "2d", 200, 4),  # 50 steps: phase bounds inside local row and column blocks
    ((8,), (4, 2), "cols", 96, 5),
    ((2, 4), (8, 1), "replicated", 997, 64),
])
def test_process_grid(shape, grid, layout, n, tile):
    """The 2D process grid (any grid of the mesh's devices, whatever the mesh's shape): factor, solve,
    log-determinant, inverse and the failing minor's ``info`` on any process row and column match LAPACK's."""
    mesh = make_mesh(shape)
    a, b = hpd(n, np.float32, seed=n), rhs(n, 3, np.float32)
    ad = put(a, mesh, layout)
    factor, status = sx.linalg.potrf(ad, tile=tile, grid=grid, return_status=True)
    close(factor, np.linalg.cholesky(a), np.float32)
    assert int(status) == 0 and factor.sharding == ad.sharding
    # (every call with the options of the broken matrices' below: one program each for potrf and potrs)
    x, logdet, solve_status = sx.linalg.potrs(ad, jnp.asarray(b), tile=tile, grid=grid, return_logdet=True,
                                              return_status=True)
    close(x, sl.cho_solve(sl.cho_factor(a), b), np.float32)
    close(logdet, np.linalg.slogdet(a.astype(np.float64))[1], np.float32)
    assert int(solve_status) == 0
    inverse = sx.linalg.potri(ad, tile=tile, grid=grid)
    close(inverse, np.linalg.inv(a), np.float32, scale=3.0)
    assert inverse.sharding == ad.sharding
    t = BlockCyclic.create(n, tile, mesh.size).tile
    for bad in (t + 2, n // 2 + 1, n):  # blocks 1, ~middle and last: different grid rows and columns
        broken = a.copy()
        broken[bad - 1, bad - 1] = -1.0
        bd = put(broken, mesh, layout)
        factor, status = sx.linalg.potrf(bd, tile=tile, grid=grid, return_status=True)
        x, _, solve_status = sx.linalg.potrs(bd, jnp.asarray(b), tile=tile, grid=grid, return_logdet=True,
                                             return_status=True)
        assert int(status) == int(solve_status) == first_bad_minor(broken) == bad
        assert np.isnan(np.asarray(factor)).all() and np.isnan(np.asarray(x)).all()


def test_process_grid_under_mesh_contexts():
    """The grid runs on its own mesh of the same devices: with a mesh of explicit axes eagerly, inside jit under
    ``jax.set_mesh`` of it (the gradient of ``logdet`` too), and under a context mesh of automatic axes."""
    n = 40
    a, b = hpd(n, np.float32, seed=7), rhs(n, 3, np.float32)
    want = sl.cho_solve(sl.cho_factor(a), b)
    explicit = jax.make_mesh((2, 4), ("h", "d"))
    a_cols = jax.device_put(jnp.asarray(a), NamedSharding(explicit, P(None, ("h", "d"))))
    factor = sx.linalg.potrf(a_cols, tile=4, grid=(2, 4))
    assert factor.sharding == a_cols.sharding
    close(factor, np.linalg.cholesky(a), np.float32)
    with jax.set_mesh(explicit):
        rows = jax.device_put(jnp.asarray(a), NamedSharding(explicit, P("h", None)))
        x = jax.jit(lambda y, r: sx.linalg.potrs(y, r, tile=4, grid=(4, 2)))(rows, jnp.asarray(b))
        grad = jax.jit(jax.grad(lambda y: sx.linalg.potrs(y, jnp.asarray(b), tile=4, grid=(2, 4),
                                                          return_logdet=True)[1]))(rows)
    close(x, want, np.float32)
    inverse = np.linalg.inv(a)
    close(grad, np.tril(2 * inverse, -1) + np.diag(np.diag(inverse)), np.float32, scale=3.0)
    auto = make_mesh((8,))
    with jax.set_mesh(auto):
        close(sx.linalg.potrs(jnp.asarray(a), jnp.asarray(b), tile=4, grid=(2, 4)), want, np.float32)
        close(jax.jit(lambda y: sx.linalg.potri(y, tile=4, grid=(2, 4)))(jnp.asarray(a)), inverse, np.float32,
              scale=3.0)


def _largest_buffer(hlo: str) -> int:
    """Elements of the largest f32 array in a compiled (per-device) program's text."""
    sizes = [int(np.prod([int(d) for d in dims.split(",")])) for dims in re.findall(r"f32\[([0-9,]+)\]", hlo)]
    return max(sizes)


def test_layout_changes_never_gather_the_matrix():
    """Between a user layout such as rows ``P("x", None)`` or 2D ``P("x", "y")`` and the block-cyclic columns XLA's
    partitioner gathers the whole matrix on every device unless led through intermediate layouts: no per-device
    buffer of the compiled ``potrf``/``potrs`` is larger than the user's own shard or ``N^2 / P``."""
    from shardax.linalg import _api

    mesh = make_mesh((2, 4))
    n = 256
    for spec, shard in [(P("x", None), n * n // 2), (P("x", "y"), n * n // 8), (P(None, "y"), n * n // 4)]:
        sharding = NamedSharding(mesh, spec)
        a = jax.device_put(np.eye(n, dtype=np.float32), sharding)
        bound = max(shard, n * n // 8)
        for grid in [1, 2] if spec == P("x", None) else [1]:
            layout = BlockCyclic.create(n, 8, 8, grid)
            factor = _api._factor(mesh, layout, False, sharding).lower(a).compile().as_text()
            assert _largest_buffer(factor) <= bound, (spec, grid)
        solve = _api._solver(mesh, BlockCyclic.create(n, 8, 8), False, None).lower(a, jnp.ones((n, 2), jnp.float32))
        assert _largest_buffer(solve.compile().as_text()) <= bound, spec


@pytest.mark.parametrize(("shape", "rows"), [((4,), 2), ((2, 4), 2), ((8,), 4)])
def test_grid_layout_exchange(shape, rows):
    """``to_grid_local`` gives each grid position its blocks of the 1D columns (block ``(i, j)`` on ``(i % rows,
    j % cols)`` as local block ``(i // rows, j // cols)``), and ``to_columns_local`` brings them back."""
    mesh = make_mesh(shape)
    n = 45
    layout = BlockCyclic.create(n, 3, mesh.size, rows)
    grid = grid_mesh(mesh, layout)
    assert grid.axis_names == (ROW, COL) and grid.devices.shape == (rows, mesh.size // rows)
    assert list(grid.devices.flat) == list(mesh.devices.flat)
    a = np.arange(n * n, dtype=np.float32).reshape(n, n)
    columns = to_cyclic(jnp.asarray(a), layout)
    blocks = sx.smap(lambda x: to_grid_local(x, layout), in_specs=(cyclic_spec(grid),), out_specs=P(ROW, COL),
                     mesh=grid, expand=False)(columns)
    padded = np.eye(layout.padded, dtype=np.float32)
    padded[:n, :n] = a
    t, height, width = layout.tile, layout.padded // rows, layout.padded // layout.cols
    for p in range(rows):
        for q in range(layout.cols):
            local = np.asarray(blocks)[p * height:(p + 1) * height, q * width:(q + 1) * width]
            for i in range(height // t):
                for j in range(width // t):
                    gi, gj = i * rows + p, j * layout.cols + q
                    np.testing.assert_array_equal(local[i * t:(i + 1) * t, j * t:(j + 1) * t],
                                                  padded[gi * t:(gi + 1) * t, gj * t:(gj + 1) * t])
    back = sx.smap(lambda x: to_columns_local(to_grid_local(x, layout), layout), in_specs=(cyclic_spec(grid),),
                   out_specs=cyclic_spec(grid), mesh=grid, expand=False)(columns)
    np.testing.assert_array_equal(np.asarray(from_cyclic(back, layout)), a)


@pytest.mark.parametrize("dtype", [np.float64, np.complex64, np.complex128])
def test_dtypes(dtype):
    mesh = make_mesh((2, 2))
    n = 36
    with jax.enable_x64(True):
        a, b = hpd(n, dtype, seed=4), rhs(n, 2, dtype)
        ad = put(a, mesh, "2d")
        x, logdet = sx.linalg.potrs(ad, jnp.asarray(b), tile=4, return_logdet=True)
        assert x.dtype == dtype
        close(x, sl.cho_solve(sl.cho_factor(a), b), dtype)
        close(logdet, np.linalg.slogdet(a)[1], dtype)
        close(sx.linalg.potrf(ad, tile=4), np.linalg.cholesky(a), dtype)
        close(sx.linalg.potri(ad, tile=4), np.linalg.inv(a), dtype, scale=3.0)
        w, v = sx.linalg.syevd(ad)
        check_eigh(a, w, v, dtype)


def test_ill_conditioned_f64():
    mesh = make_mesh((2, 4))
    n, cond = 80, 1e8
    with jax.enable_x64(True):
        a, b = hpd(n, np.float64, seed=5, cond=cond), rhs(n, 1, np.float64)
        x = np.asarray(sx.linalg.potrs(put(a, mesh, "cols"), jnp.asarray(b), tile=7))
    eps = np.finfo(np.float64).eps
    residual = np.linalg.norm(a @ x - b) / (np.linalg.norm(a, 2) * np.linalg.norm(x))
    assert residual < 100 * n * eps
    reference = sl.cho_solve(sl.cho_factor(a), b)
    assert np.linalg.norm(x - reference) / np.linalg.norm(reference) < 100 * cond * eps


def test_vector_and_many_rhs():
    mesh = make_mesh((4,))
    n = 32
    a = hpd(n, np.float32, seed=6)
    ad = put(a, mesh, "rows")
    for k in (None, 17):
        b = rhs(n, k, np.float32)
        x = sx.linalg.potrs(ad, jnp.asarray(b), tile=4)
        assert x.shape == b.shape
        close(x, np.linalg.solve(a, b), np.float32)


@pytest.mark.parametrize("bad", [1, 13, 32])
def test_not_positive_definite(bad):
    mesh = make_mesh((2, 2))
    n = 32
    a = hpd(n, np.float32, seed=7)
    a[bad - 1, bad - 1] = -1.0
    expected = first_bad_minor(a)
    assert expected == bad
    ad, b = put(a, mesh, "cols"), jnp.ones(n, jnp.float32)
    x, logdet, status = sx.linalg.potrs(ad, b, tile=3, return_logdet=True, return_status=True)
    assert int(status) == expected
    assert np.isnan(np.asarray(x)).all() and np.isnan(float(logdet))
    factor, status = sx.linalg.potrf(ad, tile=3, return_status=True)
    assert int(status) == expected and np.isnan(np.asarray(factor)).all()
    inverse, status = sx.linalg.potri(ad, tile=3, return_status=True)
    assert int(status) == expected and np.isnan(np.asarray(inverse)).all()


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_recursive_diagonal_blocks(dtype):
    """Tiles above the leaf size (32) factor and invert their diagonal blocks by recursive halving (uneven halves
    here); a failure inside such a block still reports LAPACK's ``info``."""
    mesh = make_mesh((2,))
    n, tile = 150, 70
    with jax.enable_x64(True):
        a = hpd(n, dtype, seed=12)
        ad = put(a, mesh, "cols")
        factor, status = sx.linalg.potrf(ad, tile=tile, return_status=True)  # (one program: as below)
        close(factor, np.linalg.cholesky(a), dtype)
        assert int(status) == 0
        b = rhs(n, 2, dtype)
        close(sx.linalg.potrs(ad, jnp.asarray(b), tile=tile), sl.cho_solve(sl.cho_factor(a), b), dtype)
        close(sx.linalg.potri(ad, tile=tile), np.linalg.inv(a), dtype, scale=3.0)
        a[100, 100] = -1.0
        factor, status = sx.linalg.potrf(put(a, mesh, "cols"), tile=tile, return_status=True)
    assert int(status) == first_bad_minor(a) == 101
    assert np.isnan(np.asarray(factor)).all()


def test_solver_library_path(monkeypatch):
    """The path GPUs take (cuSOLVER-style potrf + triangular solves per diagonal block), forced on CPU devices: the
    same factor, solution, inverse and ``info`` as the matrix-product path."""
    from shardax.linalg import _potrf

    monkeypatch.setattr(_potrf, "solver_library", lambda: True)
    n, tile = 90, 16
    for shape, grid in [((2,), None), ((4,), (2, 2))]:
        mesh = make_mesh(shape)
        with jax.enable_x64(True):
            a = hpd(n, np.float64, seed=13)
            ad = put(a, mesh, "replicated")
            factor, status = sx.linalg.potrf(ad, tile=tile, return_status=True, grid=grid)  # (as below: one program)
            close(factor, np.linalg.cholesky(a), np.float64)
            assert int(status) == 0
            b = rhs(n, 2, np.float64)
            close(sx.linalg.potrs(ad, jnp.asarray(b), tile=tile, grid=grid), sl.cho_solve(sl.cho_factor(a), b),
                  np.float64)
            close(sx.linalg.potri(ad, tile=tile, grid=grid), np.linalg.inv(a), np.float64, scale=3.0)
            a[40, 40] = -1.0
            factor, status = sx.linalg.potrf(put(a, mesh, "replicated"), tile=tile, return_status=True, grid=grid)
        assert int(status) == first_bad_minor(a) == 41
        assert np.isnan(np.asarray(factor)).all()


def test_only_lower_triangle_is_read():
    mesh = make_mesh((4,))
    n = 24
    a = hpd(n, np.float32, seed=8)
    garbage = np.tril(a) + np.triu(np.full((n, n), 7.0, np.float32), 1)
    b = jnp.ones((n, 1), jnp.float32)
    assert not np.allclose(garbage, garbage.T)  # the upper triangle really is garbage
    close(sx.linalg.potrs(put(garbage, mesh, "cols"), b, tile=4), np.linalg.solve(a, np.ones((n, 1))), np.float32)
    close(sx.linalg.syevd(put(garbage, mesh, "cols"), return_eigenvectors=False), np.linalg.eigvalsh(a),
          np.float32, scale=10.0)


def test_jaxmg_positional_call():
    mesh = make_mesh((2, 4))
    n = 32
    a, b = hpd(n, np.float32, seed=9), rhs(n, 1, np.float32)
    reference = np.linalg.solve(a, b)
    x = sx.linalg.potrs(a, b, 4, mesh, (P(None, ("x", "y")), P(None, None)))
    close(x, reference, np.float32)
    x, status = sx.linalg.potrs(jnp.asarray(a), jnp.asarray(b), T_A=256, mesh=mesh,
                                in_specs=(P(None, "T"), P(None, None)), return_status=True)
    close(x, reference, np.float32)
    assert int(status) == 0


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda a, b: sx.linalg.potrs(a[:, :5], b), ValueError, "square"),
    (lambda a, b: sx.linalg.potrs(a, b[:5]), ValueError, "b must have shape"),
    (lambda a, b: sx.linalg.potrs(a, b.astype(jnp.int32)), TypeError, "b has dtype"),
    (lambda a, b: sx.linalg.potrs(a.astype(jnp.int32), b), TypeError, "a has dtype int32"),
    (lambda a, b: sx.linalg.potrs(a, b, tile=0), ValueError, "tile must be a positive int"),
    (lambda a, b: sx.linalg.potrs(a, b, tile=2.5), TypeError, "tile must be a positive int"),
    (lambda a, b: sx.linalg.potrs(a, b, 8, tile=4), ValueError, "T_A=8 and tile=4 disagree"),
    (lambda a, b: sx.linalg.potrs(a, b, in_specs=P()), TypeError, "in_specs must be a pair"),
    (lambda a, b: sx.linalg.potrs(a, b, mesh="x"), TypeError, "mesh must be"),
    (lambda a, b: sx.linalg.potrs(a, b, return_status=1), TypeError, "return_status must be True or False"),
    (lambda a, b: sx.linalg.potrf(a, tile=True), TypeError, "tile must be a positive int"),
    (lambda a, b: sx.linalg.potrs(a, b, grid=(3, 3)), ValueError, r"grid=\(3, 3\) must .* 8 devices, e.g. \(2, 4\)"),
    (lambda a, b: sx.linalg.potri(a, grid=(0, 8)), ValueError, "must be positive"),
    (lambda a, b: sx.linalg.potrf(a, grid="2x4"), TypeError, "grid must be None or a pair"),
    (lambda a, b: sx.linalg.potrf(a, grid=(2.0, 4)), TypeError, "grid must be None or a pair"),
    (lambda a, b: sx.linalg.potri(a[None]), ValueError, "square"),
    (lambda a, b: sx.linalg.syevd(a, max_sweeps=0), ValueError, "max_sweeps"),
    (lambda a, b: sx.linalg.syevd(a, method="qr"), ValueError, "method"),
    (lambda a, b: sx.linalg.syevd([[1.0]]), TypeError, "jax.Array or numpy array"),
    (lambda a, b: sx.linalg.syevd(a, tile=0), ValueError, "tile must be a positive int .* try 32"),
    (lambda a, b: sx.linalg.syevd(a, tile=2.5), TypeError, "tile must be a positive int"),
    (lambda a, b: sx.linalg.syevd(a, method="jacobi", tile=-1), ValueError, "tile must be a positive int"),
    (lambda a, b: sx.linalg.syevd(a, tuning="tpu"), ValueError, "tuning must be one of"),
    (lambda a, b: sx.linalg.LinalgTuning(reduction_tile=0), ValueError, "LinalgTuning.reduction_tile"),
])
def test_errors(call, error, match):
    a, b = jnp.eye(8, dtype=jnp.float32), jnp.ones(8, jnp.float32)
    with pytest.raises(error, match=match):
        call(a, b)


@pytest.mark.parametrize(("shape", "dtype", "grid"), [((1,), np.float64, None), ((2, 2), np.float64, None),
                                                   ((4,), np.complex128, None), ((2, 2), np.complex128, (2, 2))])
def test_gradients(shape, dtype, grid):
    mesh = make_mesh(shape)
    n = 12
    with jax.enable_x64(True):
        a, b = jnp.asarray(hpd(n, dtype, seed=10)), jnp.asarray(rhs(n, 2, dtype))
        check_grads(lambda a, b: sx.linalg.potrs(a, b, tile=3, mesh=mesh, grid=grid), (a, b), order=1,
                    modes=["rev"])
        check_grads(lambda a: sx.linalg.potrs(a, b, tile=3, mesh=mesh, return_logdet=True, grid=grid)[1], (a,),
                    order=1, modes=["rev"])
        logdet = sx.linalg.potrs(a, b, tile=3, mesh=mesh, return_logdet=True, grid=grid)[1]
    assert np.isclose(float(logdet), np.linalg.slogdet(np.asarray(a))[1], rtol=1e-10)


def test_gpu_preset_factors_float64_whole_on_one_device():
    """On one device the GPU preset factors float64 matrices as one block: the same solution, log-determinant,
    factor, inverse and failure status as the blocked factorisation; float32 and meshes of several devices stay
    blocked."""
    mesh = make_mesh((1,))
    big = 8192
    assert default_tile(big, 1, "gpu", dtype=np.float64) == default_tile(big, 1, "gpu", dtype=np.complex128) == big
    assert default_tile(big, 1, "gpu", dtype=np.float32) == default_tile(big, 2, "gpu", dtype=np.float64) == 512
    assert default_tile(big, 1, "cpu", dtype=np.float64) == 256
    n = 40
    with jax.enable_x64(True):
        a, b = jnp.asarray(hpd(n, np.float64, seed=12)), jnp.asarray(rhs(n, 2, np.float64))
        x, logdet = sx.linalg.potrs(a, b, mesh=mesh, tuning="gpu", return_logdet=True)
        close(x, np.linalg.solve(np.asarray(a), np.asarray(b)), np.float64)
        close(logdet, np.linalg.slogdet(np.asarray(a))[1], np.float64)
        close(sx.linalg.potrf(a, mesh=mesh, tuning="gpu"), np.linalg.cholesky(np.asarray(a)), np.float64)
        close(sx.linalg.potri(a, mesh=mesh, tuning="gpu"), np.linalg.inv(np.asarray(a)), np.float64, scale=10.0)
        broken = a.at[7, 7].set(-1.0)
        _, info = sx.linalg.potrs(broken, b, mesh=mesh, tuning="gpu", return_status=True)
        _, blocked_info = sx.linalg.potrs(broken, b, mesh=mesh, tile=8, return_status=True)
    assert int(info) == int(blocked_info) == 8
    with pytest.raises(ValueError, match="whole_dtypes"):
        sx.linalg.LinalgTuning(whole_dtypes=("nope",))
    with pytest.raises(ValueError, match="whole_dtypes"):
        sx.linalg.LinalgTuning(whole_dtypes=["float64"])  # type: ignore[arg-type]


def test_local_view_runs_without_mesh():
    n = 20
    a, b = hpd(n, np.float32, seed=11), rhs(n, 2, np.float32)
    layout = BlockCyclic.create(n, 6, 1)
    cyclic = to_cyclic(jnp.asarray(a), layout)
    padded_b = jnp.pad(jnp.asarray(b), ((0, layout.padded - n), (0, 0)))
    x, logdet, info = solve_local(cyclic, padded_b, layout, True)
    close(x[:n], np.linalg.solve(a, b), np.float32)
    close(logdet, np.linalg.slogdet(a)[1], np.float32)
    factor, info = potrf_local(cyclic, layout)
    close(from_cyclic(factor, layout), np.linalg.cholesky(a), np.float32)
    w, _, sweeps, converged = jacobi_eigh_local(jnp.asarray(a), 5)
    assert bool(converged) and int(sweeps) == 1 and int(info) == 0
    close(jnp.sort(w), np.linalg.eigvalsh(a), np.float32, scale=10.0)


@pytest.mark.parametrize(("shape", "layout", "n"), [((1,), "cols", 40), ((4,), "rows", 40), ((2, 4), "2d", 40),
                                                     ((2, 4), "replicated", 37)])
def test_syevd(shape, layout, n):
    mesh = make_mesh(shape)
    rng = np.random.default_rng(n)
    m = rng.standard_normal((n, n)).astype(np.float32)
    a = (m + m.T) / 2
    ad = put(a, mesh, layout)
    w, v, status = sx.linalg.syevd(ad, return_status=True)
    assert int(status) == 0
    check_eigh(a, w, v, np.float32)
    assert v.shape == (n, n) and (layout == "replicated" or v.sharding == ad.sharding)


@pytest.mark.parametrize(("shape", "tile", "used"), [((1,), 8, None), ((8,), 3, 3), ((2, 4), 4, 4)])
def test_syevd_tile_and_tuning(monkeypatch, shape, tile, used):
    """A non-default ``tile`` (or the tuning's ``reduction_tile``) sets the reduction's block-cyclic layout on several
    devices; one device runs LAPACK's ``eigh`` whatever the tile. Results match ``numpy.linalg.eigh``."""
    import shardax.linalg._api as api

    tiles: list[int | None] = []
    layout = api.tridiagonal_layout
    monkeypatch.setattr(api, "tridiagonal_layout", lambda n, size, tile: tiles.append(tile) or layout(n, size, tile))
    mesh = make_mesh(shape)
    n = 40
    rng = np.random.default_rng(n)
    m = rng.standard_normal((n, n)).astype(np.float32)
    a = (m + m.T) / 2
    w_ref, _ = np.linalg.eigh(a)
    w, v, status = sx.linalg.syevd(put(a, mesh, "rows"), tile=tile, return_status=True)
    assert int(status) == 0
    check_eigh(a, w, v, np.float32)
    close(w, w_ref, np.float32, scale=10.0)
    tuned = sx.linalg.syevd(put(a, mesh, "cols"), tuning=sx.linalg.LinalgTuning(reduction_tile=tile),
                            return_eigenvectors=False)
    close(tuned, w_ref, np.float32, scale=10.0)
    assert tiles == ([] if used is None else [used, used])
    assert tridiagonal_layout(n, 8, 3).tile == 3 and tridiagonal_layout(n, 8).tile == 5  # 32, reduced for n = 40


def test_syevd_degenerate_spectrum():
    mesh = make_mesh((2, 2))
    n = 32
    u = rhs(n, None, np.float32, seed=12)
    a = np.eye(n, dtype=np.float32) * 2 + np.outer(u, u) / n
    w, v = sx.linalg.syevd(put(a, mesh, "cols"))
    check_eigh(a, w, v, np.float32)
    assert np.sum(np.isclose(np.asarray(w), 2.0, atol=1e-4)) == n - 1  # the (n - 1)-fold eigenvalue 2


def with_spectrum(w: np.ndarray, dtype, seed: int = 0) -> np.ndarray:
    """A random Hermitian matrix with eigenvalues ``w``."""
    n = len(w)
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((n, n))
    if np.dtype(dtype).kind == "c":
        m = m + 1j * rng.standard_normal((n, n))
    q, _ = np.linalg.qr(m)
    a = (q * w) @ q.conj().T
    return ((a + a.conj().T) / 2).astype(dtype)


def wilkinson(n: int) -> np.ndarray:
    """Wilkinson's ``W_n^+`` (tridiagonal, unreduced): its largest eigenvalues come in pairs closer than 1e-14."""
    half = (n - 1) // 2
    return np.diag(np.abs(half - np.arange(n)).astype(np.float64)) + np.diag(np.ones(n - 1), 1) + np.diag(
        np.ones(n - 1), -1)


def near_identity(n: int) -> np.ndarray:
    """Tridiagonal, unreduced, all eigenvalues within 4e-9 of 1: one cluster longer than the window."""
    off = np.full(n - 1, 1e-9)
    return np.eye(n) + np.diag(off, 1) + np.diag(off, -1)


@pytest.mark.parametrize(("shape", "dtype", "n"), [((4,), np.float64, 45), ((2, 4), np.complex128, 61),
                                                   ((2, 2), np.complex64, 30), ((8,), np.float32, 3)])
def test_syevd_tridiagonal_any_n(shape, dtype, n):
    """The default solver on sizes that do not split over the devices (padding), real and complex."""
    mesh = make_mesh(shape)
    rng = np.random.default_rng(n)
    m = rng.standard_normal((n, n))
    if np.dtype(dtype).kind == "c":
        m = m + 1j * rng.standard_normal((n, n))
    a = ((m + m.conj().T) / 2).astype(dtype)
    with jax.enable_x64(True):
        ad = put(a, mesh, "replicated")
        w, v, status = sx.linalg.syevd(ad, return_status=True)
        assert int(status) == 0 and w.dtype == np.finfo(dtype).dtype and v.dtype == dtype
        check_eigh(a, w, v, dtype)
        close(sx.linalg.syevd(ad, return_eigenvectors=False), np.linalg.eigvalsh(a), dtype, scale=10.0)


@pytest.mark.parametrize(("shape", "kind", "dtype"), [((2, 4), "wilkinson", np.float64),
                                                      ((4,), "repeated", np.complex128),
                                                      ((4,), "near_identity", np.float64),
                                                      ((2, 2), "identity", np.float32)])
def test_syevd_clusters(shape, kind, dtype):
    """Close and repeated eigenvalues: reorthogonalised clusters (Wilkinson pairs fall across device boundaries), a
    cluster longer than the window (dense fallback), exact multiplicities (split into 1 x 1 blocks)."""
    mesh = make_mesh(shape)
    with jax.enable_x64(True):
        a = {"wilkinson": lambda: wilkinson(63),
             "repeated": lambda: with_spectrum(np.r_[np.ones(12), 2 * np.ones(9), np.linspace(3, 4, 29)], dtype),
             "near_identity": lambda: near_identity(70),
             "identity": lambda: np.eye(50)}[kind]().astype(dtype)
        w, v, status = sx.linalg.syevd(put(a, mesh, "replicated"), return_status=True)
        assert int(status) == 0
        check_eigh(a, w, v, dtype)


@pytest.mark.parametrize(("a", "fallback"), [(wilkinson(33), False), (near_identity(40), True),
                                             (with_spectrum(np.linspace(-1, 1, 40), np.complex128), False)])
def test_tridiagonal_paths_without_mesh(a, fallback):
    """The local view: inverse iteration with reorthogonalisation, or the dense fallback for a long cluster."""
    with jax.enable_x64(True):
        layout = tridiagonal_layout(len(a), 1)
        w, v, used = tridiagonal_eigh_local(to_cyclic(jnp.asarray(a), layout), layout, True)
        assert bool(used) == fallback
        padded = np.eye(layout.padded, dtype=a.dtype)  # to_cyclic pads with the identity
        padded[: len(a), : len(a)] = a
        order = np.argsort(np.asarray(w))
        check_eigh(padded, np.asarray(w)[order], np.asarray(v)[:, order], a.dtype)


@pytest.mark.parametrize("method", ["tridiagonal", "jacobi"])
def test_syevd_non_finite(method):
    """NaN or inf in the lower triangle: status 1 and NaN outputs; the upper triangle is never read."""
    mesh = make_mesh((2, 2))
    a = hpd(20, np.float32, seed=13)
    for value in (np.nan, np.inf):
        bad = a.copy()
        bad[7, 3] = value
        w, v, status = sx.linalg.syevd(put(bad, mesh, "cols"), return_status=True, method=method)
        assert int(status) == 1 and np.isnan(np.asarray(w)).all() and np.isnan(np.asarray(v)).all()
        w, v, status = sx.linalg.syevd(put(bad.T.copy(), mesh, "cols"), return_status=True, method=method)
        assert int(status) == 0
        check_eigh(a, w, v, np.float32)


def test_syevd_jacobi_method():
    mesh = make_mesh((2, 4))
    a = hpd(32, np.float32, seed=14)
    w, v, status = sx.linalg.syevd(put(a, mesh, "2d"), return_status=True, method="jacobi", max_sweeps=20)
    assert int(status) == 0
    check_eigh(a, w, v, np.float32)


def test_mesh_with_explicit_axes():
    """Meshes from jax.make_mesh (explicit axes by default): plain and sharded inputs, results in the input's
    sharding, jaxmg's host_replicate step eagerly and inside jit."""
    rng = np.random.default_rng(5)
    m = rng.standard_normal((40, 40))
    a = (m @ m.T / 40 + np.eye(40)).astype(np.float32)
    b = rng.standard_normal((40, 3)).astype(np.float32)
    flat, grid = jax.make_mesh((8,), ("x",)), jax.make_mesh((2, 4), ("h", "d"))
    assert jax.sharding.AxisType.Explicit in grid.axis_types
    x = sx.linalg.potrs(jnp.asarray(a), jnp.asarray(b), tile=8, mesh=flat)
    np.testing.assert_allclose(np.asarray(x), sl.cho_solve(sl.cho_factor(a), b), rtol=2e-4, atol=2e-4)
    a_cols = jax.device_put(jnp.asarray(a), NamedSharding(grid, P(None, ("h", "d"))))
    factor = sx.linalg.potrf(a_cols, tile=8)
    assert factor.sharding == a_cols.sharding
    np.testing.assert_allclose(np.asarray(factor), np.linalg.cholesky(a), rtol=2e-4, atol=2e-4)
    w, v = sx.linalg.syevd(a_cols)
    assert v.sharding == a_cols.sharding
    np.testing.assert_allclose(np.asarray(w), np.linalg.eigvalsh(a), rtol=1e-4, atol=1e-4)
    replicated = sx.host_replicate(a_cols, grid, axis="h")
    assert replicated.sharding.spec == P(None, "d")
    inside = jax.jit(lambda y: sx.host_replicate(y, grid, axis="h"))(a_cols)
    assert inside.sharding.spec == P(None, "d")
    b_rows = jax.device_put(jnp.asarray(b), NamedSharding(grid, P("h", None)))
    x = sx.linalg.potrs(replicated, b_rows, 8, grid, (P(None, "T"), P(None, None)))
    assert x.sharding == b_rows.sharding
    np.testing.assert_allclose(np.asarray(x), sl.cho_solve(sl.cho_factor(a), b), rtol=2e-4, atol=2e-4)


def test_explicit_context_mesh_eager_and_inside_jit():
    """Under jax.set_mesh of a mesh with explicit axes, no mesh argument: eagerly, inside the caller's jit on an
    array made outside the context, and inside jit on arrays made in it (traced with explicit axes: the call runs
    under ``auto_axes`` and its outputs are typed on the explicit mesh)."""
    rng = np.random.default_rng(6)
    m = rng.standard_normal((24, 24))
    a = (m @ m.T / 24 + np.eye(24)).astype(np.float32)
    b = rng.standard_normal((24, 2)).astype(np.float32)
    want = np.linalg.cholesky(a)
    outside = jnp.asarray(a)
    mesh = jax.make_mesh((8,), ("x",))
    with jax.set_mesh(mesh):
        eager = sx.linalg.potrf(jnp.asarray(a), tile=4)
        inside = jax.jit(lambda y: sx.linalg.potrf(y, tile=4))(outside)
        rows = jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("x", None)))
        rhs = jnp.asarray(b)
        x, logdet, status = jax.jit(lambda y, r: sx.linalg.potrs(y, r, tile=4, return_logdet=True,
                                                                 return_status=True))(rows, rhs)
        factor = jax.jit(lambda y: sx.linalg.potrf(y, tile=4))(rows)
        inverse, inverse_status = jax.jit(lambda y: sx.linalg.potri(y, tile=4, return_status=True))(rows)
        w, v = jax.jit(sx.linalg.syevd)(rows)
        w_jacobi = jax.jit(lambda y: sx.linalg.syevd(y, method="jacobi", return_eigenvectors=False))(rows)
    for got in (eager, inside, factor):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
    assert jax.typeof(factor).sharding.spec == P("x", None) and x.shape == b.shape
    np.testing.assert_allclose(np.asarray(x), sl.cho_solve(sl.cho_factor(a), b), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(float(logdet), np.linalg.slogdet(a)[1], rtol=1e-4, atol=1e-4)
    assert int(status) == 0 and int(inverse_status) == 0
    np.testing.assert_allclose(np.asarray(inverse), np.linalg.inv(a), rtol=2e-3, atol=2e-3)
    for eigenvalues in (w, w_jacobi):
        np.testing.assert_allclose(np.asarray(eigenvalues), np.linalg.eigvalsh(a), rtol=1e-4, atol=1e-4)
    check_eigh(a, w, v, np.float32)
