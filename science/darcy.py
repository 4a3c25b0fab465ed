"""2-D Darcy flow data: the FNO paper's headline 2-D benchmark, generated locally (no download).

The task (Li et al. 2021, "Fourier Neural Operator for Parametric PDEs", section 5.2) maps the
coefficient ``a(x)`` to the solution ``u(x)`` of

    -div(a(x) grad u(x)) = 1   on (0, 1)^2,   u = 0 on the boundary,

where ``a`` is 12 where a Gaussian random field ``psi ~ N(0, (-Laplacian + 9 I)^-2)`` (zero Neumann
boundary) is ``>= 0`` and 3 elsewhere. The paper trains and tests on 85 x 85 points (its s = 85 row:
every 5th point of a 421-point solve).

The solver is the paper's finite-difference scheme (``solve_gwf.m``): nodes ``x_i = i / (K - 1)``
including the boundary, the 5-point stencil with the arithmetic mean of ``a`` on each face, as a scipy
sparse matrix. It is solved by conjugate gradients preconditioned with the constant-coefficient
Laplacian (inverted exactly by a DST-I): since ``3 <= a <= 12`` the preconditioned operator's
condition number is at most 12 / 3 = 4, so about 25 iterations reach 1e-10 at any grid size (a direct
sparse solve of the paper's 421-point grid takes seconds per sample; this takes about half a second).

Dataset: per-sample random streams (independent of chunking and worker count; the test set does not
change with ``n_train``), the solve grid sub-sampled to the training grid, an atomic ``.npz`` cache.
"""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import scipy.fft
import scipy.sparse
import scipy.sparse.linalg
from threadpoolctl import threadpool_limits

from science.cache import DataError, ProgressFn, params_digest, progress_bar, read_cached_arrays, write_npz_atomic

logger = logging.getLogger(__name__)

# Bump when the generated numbers change for the same parameters: old cache files then miss.
DATA_VERSION = 1
DEFAULT_CACHE_DIR = Path("~/.cache/zero-recipes/darcy")
# The paper's field and threshold (``gen_darcy.m``: GRF(alpha=2, tau=3) on s = 421 points, s x s modes).
PAPER_FIELD: dict[str, float] = {"alpha": 2.0, "tau": 3.0, "high": 12.0, "low": 3.0}
PAPER_MODES = 421
PAPER_SOLVE_GRID = 421


# ---------------------------------------------------------------------------------------------
# Coefficient fields
# ---------------------------------------------------------------------------------------------


def grf_amplitudes(n_modes: int, alpha: float = 2.0, tau: float = 3.0) -> np.ndarray:
    """Standard deviations ``[n_modes, n_modes]`` of the cosine coefficients of the paper's ``GRF.m``.

    ``tau^(alpha-1) (pi^2 (k1^2 + k2^2) + tau^2)^(-alpha/2)`` times the orthonormal inverse DCT's weights
    (1 for a zero index, sqrt(2) otherwise, per direction); the mean mode is zero.
    """
    k = np.arange(n_modes, dtype=np.float64)
    eigen = tau ** (alpha - 1.0) * (np.pi**2 * (k[:, None] ** 2 + k[None, :] ** 2) + tau**2) ** (-alpha / 2.0)
    weight = np.where(k == 0, 1.0, math.sqrt(2.0))
    amplitudes = eigen * weight[:, None] * weight[None, :]
    amplitudes[0, 0] = 0.0
    return amplitudes


def grf_at(normals: np.ndarray, points: np.ndarray, alpha: float = 2.0, tau: float = 3.0) -> np.ndarray:
    """Gaussian random fields at the tensor grid ``points x points`` of the unit square.

    ``psi(x, y) = sum_{k1, k2} A_k xi_k cos(pi k1 x) cos(pi k2 y)`` (see :func:`grf_amplitudes`): the
    paper's field as a function, so any grid samples the same field.

    Args:
        normals: ``[n_samples, M, M]`` standard normals ``xi``, one per mode.
        points: ``[P]`` coordinates in [0, 1] along each axis.
        alpha: Smoothness exponent.
        tau: Inverse length scale.

    Returns:
        ``[n_samples, P, P]`` float64.
    """
    n_modes = normals.shape[-1]
    cosines = np.cos(np.pi * np.arange(n_modes)[:, None] * np.asarray(points)[None, :])  # [M, P]
    coefficients = normals * grf_amplitudes(n_modes, alpha, tau)
    return np.einsum("km,nkl,lp->nmp", cosines, coefficients, cosines, optimize=True)


def grf_from_normals(normals: np.ndarray, grid_size: int, alpha: float = 2.0, tau: float = 3.0) -> np.ndarray:
    """:func:`grf_at` the nodes ``(i, j) / (grid_size - 1)``, boundaries included: ``[n_samples, grid, grid]``."""
    return grf_at(normals, np.arange(grid_size) / (grid_size - 1), alpha=alpha, tau=tau)


def threshold(field: np.ndarray, high: float = 12.0, low: float = 3.0) -> np.ndarray:
    """The paper's coefficient: ``high`` where ``field >= 0``, ``low`` elsewhere."""
    return np.where(field >= 0.0, high, low)


# ---------------------------------------------------------------------------------------------
# Solver
# ---------------------------------------------------------------------------------------------


def assemble_operator(a: np.ndarray) -> scipy.sparse.csr_matrix:
    """The 5-point matrix of ``-div(a grad u)`` on the interior nodes, zero Dirichlet boundary (``solve_gwf.m``).

    Nodes ``(i, j) / (K - 1)``, ``K = a.shape[0]``; unknowns are the ``(K - 2)^2`` interior nodes in
    row-major order; the coefficient on the face between two nodes is the mean of ``a`` at both.

    Args:
        a: ``[K, K]`` coefficient at every node, boundary included.

    Returns:
        ``[(K - 2)^2, (K - 2)^2]`` symmetric positive definite CSR matrix (scaled by ``1 / h^2``).
    """
    k = a.shape[0]
    if a.ndim != 2 or a.shape[1] != k or k < 3:
        raise ValueError(f"a must be a square [K, K] array with K >= 3, got shape {a.shape}")
    n = k - 2
    centre = a[1:-1, 1:-1]
    faces = {  # face coefficient towards each neighbour, [n, n]
        (0, 1): (centre + a[1:-1, 2:]) / 2,
        (0, -1): (centre + a[1:-1, :-2]) / 2,
        (1, 0): (centre + a[2:, 1:-1]) / 2,
        (-1, 0): (centre + a[:-2, 1:-1]) / 2,
    }
    index = np.arange(n * n).reshape(n, n)
    rows, cols, values = [index.ravel()], [index.ravel()], [sum(faces.values()).ravel()]
    for (di, dj), face in faces.items():
        # Neighbours on the boundary are zero: only interior-to-interior couplings enter the matrix.
        inner = (slice(max(0, -di), n - max(0, di)), slice(max(0, -dj), n - max(0, dj)))
        neighbour = (slice(max(0, di), n + min(0, di)), slice(max(0, dj), n + min(0, dj)))
        rows.append(index[inner].ravel())
        cols.append(index[neighbour].ravel())
        values.append(-face[inner].ravel())
    matrix = scipy.sparse.coo_matrix(
        (np.concatenate(values), (np.concatenate(rows), np.concatenate(cols))), shape=(n * n, n * n)
    )
    return (matrix * (k - 1) ** 2).tocsr()


def _laplacian_inverse(n: int, scale: float) -> scipy.sparse.linalg.LinearOperator:
    """``(scale * L)^-1`` for the constant-coefficient 5-point Laplacian ``L`` on ``n x n`` interior nodes.

    ``L`` is diagonalised by the type-I sine transform (orthonormal, its own inverse).
    """
    h = 1.0 / (n + 1)
    sines = np.sin(np.pi * np.arange(1, n + 1) / (2 * (n + 1))) ** 2
    eigenvalues = scale * 4.0 / h**2 * (sines[:, None] + sines[None, :])

    def apply(residual: np.ndarray) -> np.ndarray:
        spectrum = scipy.fft.dstn(residual.reshape(n, n), type=1, norm="ortho")
        return scipy.fft.idstn(spectrum / eigenvalues, type=1, norm="ortho").ravel()

    return scipy.sparse.linalg.LinearOperator((n * n, n * n), matvec=apply, dtype=np.float64)


def solve_darcy(a: np.ndarray, f: float | np.ndarray = 1.0, rtol: float = 1e-10, method: str = "cg") -> np.ndarray:
    """Solve ``-div(a grad u) = f`` on the unit square with ``u = 0`` on the boundary.

    Args:
        a: ``[K, K]`` positive coefficient at the nodes ``(i, j) / (K - 1)``.
        f: Right-hand side: a number or ``[K, K]`` values at the nodes (the boundary's are unused).
        rtol: Relative residual at which conjugate gradients stop.
        method: ``"cg"`` (preconditioned conjugate gradients, the default) or ``"direct"`` (sparse LU).

    Returns:
        ``u`` at all ``[K, K]`` nodes, zero on the boundary, float64.
    """
    a = np.asarray(a, dtype=np.float64)
    if not np.all(np.isfinite(a)) or np.min(a) <= 0:
        raise ValueError("a must be finite and positive")
    matrix = assemble_operator(a)
    n = a.shape[0] - 2
    rhs = np.broadcast_to(np.asarray(f, dtype=np.float64), a.shape)[1:-1, 1:-1].ravel()
    if method == "direct":
        interior = scipy.sparse.linalg.spsolve(matrix.tocsc(), rhs, permc_spec="MMD_AT_PLUS_A")
    elif method == "cg":
        # The geometric mean of a's range balances the preconditioner's error on both sides.
        preconditioner = _laplacian_inverse(n, math.sqrt(float(np.min(a) * np.max(a))))
        # One BLAS thread: CG's dot products are small, and BLAS threads contending for shared cores made a
        # solve 5-20x slower (measured on 2 cores next to other jobs).
        with threadpool_limits(limits=1, user_api="blas"):
            interior, info = scipy.sparse.linalg.cg(matrix, rhs, rtol=rtol, atol=0.0, M=preconditioner, maxiter=10 * n)
        if info != 0:
            raise RuntimeError(f"conjugate gradients did not reach rtol={rtol} in {info} iterations")
    else:
        raise ValueError(f"method must be 'cg' or 'direct', got {method!r}")
    u = np.zeros_like(a)
    u[1:-1, 1:-1] = interior.reshape(n, n)
    return u


# ---------------------------------------------------------------------------------------------
# Dataset generation and cache
# ---------------------------------------------------------------------------------------------


def _normals(split: int, index: int, seed: int, n_modes: int) -> np.ndarray:
    """``[n_modes, n_modes]`` standard normals of sample ``index`` of one split: its own stream."""
    return np.random.default_rng([seed, split, index]).standard_normal((n_modes, n_modes))


def coefficient(split: int, index: int, params: dict[str, Any]) -> np.ndarray:
    """The thresholded coefficient ``a`` of one sample on the solve grid (``params`` as in the cache)."""
    normals = _normals(split, index, params["seed"], params["grf_modes"])[None]
    field = grf_from_normals(normals, params["solve_grid"], alpha=params["alpha"], tau=params["tau"])[0]
    return threshold(field, high=params["high"], low=params["low"])


def _solve_range(args: tuple[int, int, int, dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Process-pool task: samples ``start..stop`` of one split -> float32 ``(a, u)`` on the dataset grid."""
    split, start, stop, params = args
    step = (params["solve_grid"] - 1) // (params["grid_size"] - 1)
    inputs, outputs = [], []
    with threadpool_limits(limits=1, user_api="blas"):  # the field's matrix products too (see solve_darcy)
        for index in range(start, stop):
            a = coefficient(split, index, params)
            inputs.append(a[::step, ::step])
            outputs.append(solve_darcy(a)[::step, ::step])
    return np.asarray(inputs, dtype=np.float32), np.asarray(outputs, dtype=np.float32)


def _solve_split(
    split: int, n: int, params: dict[str, Any], workers: int, chunk_size: int, progress: ProgressFn | None, done: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """All samples of one split, in chunks (in this process, or ``workers`` spawned ones)."""
    grid = params["grid_size"]
    tasks = [(split, i, min(i + chunk_size, n), params) for i in range(0, n, chunk_size)]
    results = []
    if workers <= 1 or len(tasks) <= 1:
        mapped = map(_solve_range, tasks)
        pool = None
    else:
        # spawn, not fork: the parent may hold torch/OpenMP threads, which fork does not survive.
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))
        mapped = pool.map(_solve_range, tasks)
    try:
        for (_, start, stop, _), result in zip(tasks, mapped, strict=True):
            results.append(result)
            done += stop - start
            if progress:
                progress(done, params["n_train"] + params["n_test"])
    finally:
        if pool is not None:
            pool.shutdown()
    if not results:
        return np.zeros((0, grid, grid), np.float32), np.zeros((0, grid, grid), np.float32), done
    return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results]), done


def cache_path(cache_dir: str | os.PathLike[str] | None, params: dict[str, Any]) -> Path:
    """Cache file for ``params``: a readable name plus a hash of all parameters."""
    name = (
        f"darcy_s{params['grid_size']}_solve{params['solve_grid']}_n{params['n_train']}+{params['n_test']}"
        f"_seed{params['seed']}_{params_digest(params)}.npz"
    )
    return Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser() / name


def generate_dataset(
    n_train: int,
    n_test: int,
    grid_size: int = 85,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    workers: int = 1,
    *,
    solve_grid: int | None = None,
    grf_modes: int = PAPER_MODES,
    alpha: float = PAPER_FIELD["alpha"],
    tau: float = PAPER_FIELD["tau"],
    high: float = PAPER_FIELD["high"],
    low: float = PAPER_FIELD["low"],
    use_cache: bool = True,
    chunk_size: int = 20,
    progress: ProgressFn | bool | None = None,
) -> dict[str, Any]:
    """Darcy pairs ``a -> u`` on ``grid_size x grid_size`` nodes, deterministic by ``seed``, cached as ``.npz``.

    Each sample is solved on ``solve_grid`` nodes per side and sub-sampled (both ``a`` and ``u``) to
    ``grid_size``: the paper solves on 421 and trains on every 5th node (85). Sample ``i`` of each split
    has its own random stream, so the data do not depend on ``workers`` or ``chunk_size``, and the test
    set does not change with ``n_train``.

    Args:
        n_train: Training pairs.
        n_test: Test pairs.
        grid_size: Nodes per side of the returned arrays, boundary included.
        seed: Seed of all randomness.
        cache_dir: Folder of the cache; default ``~/.cache/zero-recipes/darcy``.
        workers: Solver processes (1: in this process). More than one uses ``spawn``, so a calling
            script needs the ``if __name__ == "__main__":`` guard.
        solve_grid: Nodes per side of the solve; ``grid_size - 1`` must divide ``solve_grid - 1``.
            ``None``: ``grid_size``.
        grf_modes: Cosine modes per direction of the random field (the paper: 421).
        alpha: Field smoothness exponent.
        tau: Field inverse length scale.
        high: ``a`` where the field is ``>= 0``.
        low: ``a`` elsewhere.
        use_cache: Read and write the cache.
        chunk_size: Samples per solver task.
        progress: ``callback(done, total)``, or ``True`` for a tqdm bar.

    Returns:
        ``{"x_train", "y_train", "x_test", "y_test"}`` float32 arrays ``[N, grid_size, grid_size]``
        (``x`` is ``a``, ``y`` is ``u``) and ``"meta"``: the parameters, the cache path, whether it was a
        cache hit, the generation time.

    Raises:
        DataError: For impossible parameters.
    """
    solve_grid = grid_size if solve_grid is None else int(solve_grid)
    if n_train < 1 or n_test < 0:
        raise DataError(f"need n_train >= 1 and n_test >= 0, got n_train={n_train}, n_test={n_test}")
    if grid_size < 3 or solve_grid < grid_size or (solve_grid - 1) % (grid_size - 1):
        raise DataError(
            f"grid_size - 1 ({grid_size - 1}) must divide solve_grid - 1 ({solve_grid - 1}), grid_size >= 3: "
            f"e.g. grid_size=85 with solve_grid 85, 169 or 421"
        )
    if low <= 0 or high <= 0:
        raise DataError(f"the coefficient must be positive, got low={low}, high={high}")
    params = {
        "version": DATA_VERSION,
        "n_train": int(n_train),
        "n_test": int(n_test),
        "grid_size": int(grid_size),
        "solve_grid": int(solve_grid),
        "grf_modes": int(grf_modes),
        "alpha": float(alpha),
        "tau": float(tau),
        "high": float(high),
        "low": float(low),
        "seed": int(seed),
    }
    path = cache_path(cache_dir, params)
    shapes = {
        "x_train": (n_train, grid_size, grid_size),
        "y_train": (n_train, grid_size, grid_size),
        "x_test": (n_test, grid_size, grid_size),
        "y_test": (n_test, grid_size, grid_size),
    }
    cached = read_cached_arrays(path, params, shapes, logger) if use_cache else None
    if cached is not None:
        meta = {**cached["meta"], "cache_path": str(path), "cache_hit": True}
        return {**{key: cached[key] for key in shapes}, "meta": meta}

    start = time.perf_counter()
    close = None
    if progress is True:
        progress, close = progress_bar(n_train + n_test, "darcy")
    try:
        x_train, y_train, done = _solve_split(0, n_train, params, workers, chunk_size, progress or None, 0)
        x_test, y_test, _ = _solve_split(1, n_test, params, workers, chunk_size, progress or None, done)
    finally:
        if close:
            close()
    arrays = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
    meta = {"params": params, "generation_seconds": time.perf_counter() - start}
    if use_cache:
        write_npz_atomic(path, arrays, meta)
    return {**arrays, "meta": {**meta, "cache_path": str(path) if use_cache else None, "cache_hit": False}}


def refinement_error(
    n_samples: int, grid_size: int = 85, solve_grid: int = 169, seed: int = 0, grf_modes: int = PAPER_MODES
) -> dict[str, Any]:
    """The dataset's discretisation error: its first test samples solved on ``solve_grid`` and on twice as
    many cells (the same fields), compared at the dataset's ``grid_size`` nodes.

    Returns:
        ``{"rel_l2_max", "rel_l2_mean"}`` over the samples, and the grids.
    """
    fine_grid = 2 * solve_grid - 1
    errors = []
    for index in range(n_samples):  # one sample at a time: the fine solve is the largest thing held
        solutions = []
        for grid in (solve_grid, fine_grid):
            params = {"seed": seed, "grf_modes": grf_modes, "solve_grid": grid, **PAPER_FIELD}
            step = (grid - 1) // (grid_size - 1)
            solutions.append(solve_darcy(coefficient(1, index, params))[::step, ::step])
        coarse, fine = solutions
        errors.append(np.linalg.norm(coarse - fine) / np.linalg.norm(fine))
    return {
        "rel_l2_max": float(np.max(errors)),
        "rel_l2_mean": float(np.mean(errors)),
        "n_samples": int(n_samples),
        "grid_size": int(grid_size),
        "solve_grid": int(solve_grid),
        "fine_grid": int(fine_grid),
    }
