"""1-D viscous Burgers data: the FNO paper's benchmark, generated locally (no download).

The task (Li et al. 2021, "Fourier Neural Operator for Parametric PDEs", section 5.1) maps an
initial condition ``u0`` to the solution ``u(x, T=1)`` of

    u_t + (u^2 / 2)_x = nu * u_xx,   x in [0, 1) periodic,

with ``u0 ~ N(0, 625 (-Laplacian + 25 I)^-2)``. The paper's text says ``nu = 0.1`` (our default);
its public MATLAB generator uses ``nu = 1/1000`` with a rougher field (``PUBLIC_GENERATOR``), a
much harder problem: steep fronts (shocks about ten grid spacings of 1,024 wide) instead of a
nearly single-mode ``u(T)``. Both are resolved on the default 1024-point solve grid: at ``nu = 1e-3``
the solution agrees with the exact Cole-Hopf integral (:func:`cole_hopf_quadrature`) to about 1e-9
and with a run at twice the resolution and half the step to about 1e-7 (:func:`refinement_error`;
``tests/unit/test_burgers_shocks.py``).

Everything here is NumPy in float64: a batched ETDRK4 pseudo-spectral solver (Kassam & Trefethen
2005) checked against the exact Cole-Hopf solution, a dataset builder with a seed-determined,
chunk-independent sample stream and an atomic ``.npz`` cache, and a loader for users' own data.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from science.cache import DataError, ProgressFn, params_digest, progress_bar, read_cached_arrays, write_npz_atomic

logger = logging.getLogger(__name__)

# Bump when the generated numbers change for the same parameters: old cache files then miss.
DATA_VERSION = 1
DEFAULT_CACHE_DIR = Path("~/.cache/zero-recipes/burgers")
DEFAULT_SOLVE_GRID = 1024

# The paper's text (section 5.1) and its public generator (gen_burgers1.m), for the `**` of
# generate_dataset: ``generate_dataset(..., **PUBLIC_GENERATOR)``.
PAPER_TEXT: dict[str, float] = {"viscosity": 0.1, "alpha": 2.0, "tau": 5.0, "sigma": 25.0}
PUBLIC_GENERATOR: dict[str, float] = {"viscosity": 1e-3, "alpha": 2.5, "tau": 7.0, "sigma": 49.0}

# ---------------------------------------------------------------------------------------------
# Initial conditions
# ---------------------------------------------------------------------------------------------


def grf_mode_count(grid_size: int) -> int:
    """Number of Fourier modes (k = 1..K) a field sampled on ``grid_size`` points carries.

    Modes strictly below Nyquist only: a real field's Nyquist mode has no sine part, so keeping
    it would make the covariance grid-dependent.
    """
    return (grid_size - 1) // 2


def grf_from_normals(
    normals: np.ndarray, grid_size: int, alpha: float = 2.0, tau: float = 5.0, sigma: float = 25.0
) -> np.ndarray:
    """Evaluate Gaussian-random-field samples from standard normals, on a periodic grid.

    The field is the Karhunen-Loeve expansion of ``N(0, sigma^2 (-Laplacian + tau^2 I)^-alpha)`` on
    [0, 1) with the mean mode set to zero, as in the FNO paper's ``GRF1.m``:

        u(x) = sum_k sqrt(2) sigma ((2 pi k)^2 + tau^2)^(-alpha/2) (a_k cos 2 pi k x + b_k sin 2 pi k x)

    Args:
        normals: ``[n_samples, K, 2]`` standard normals, ``[..., 0]`` for cosines, ``[..., 1]`` for
            sines, mode-major so that the first modes do not depend on how many are drawn.
            Modes beyond ``grf_mode_count(grid_size)`` are ignored.
        grid_size: Number of points ``x_j = j / grid_size``.
        alpha: Smoothness exponent (``gamma`` in ``GRF1.m``).
        tau: Inverse length scale.
        sigma: Amplitude (the covariance carries ``sigma**2``).

    Returns:
        ``[n_samples, grid_size]`` float64 fields.
    """
    n_modes = min(normals.shape[1], grf_mode_count(grid_size))
    k = np.arange(1, n_modes + 1, dtype=np.float64)
    amplitude = math.sqrt(2.0) * sigma * ((2.0 * np.pi * k) ** 2 + tau**2) ** (-alpha / 2.0)
    coeffs = np.zeros((normals.shape[0], grid_size // 2 + 1), dtype=np.complex128)
    # irfft computes (1/n) [c_0 + 2 Re sum_k c_k e^{2 pi i k j / n}]: c_k = n/2 (a - i b) gives a cos + b sin.
    a, b = normals[:, :n_modes, 0], normals[:, :n_modes, 1]
    coeffs[:, 1 : n_modes + 1] = 0.5 * grid_size * amplitude * (a - 1j * b)
    return np.fft.irfft(coeffs, n=grid_size, axis=-1)


def sample_grf(
    n_samples: int, grid_size: int, rng: np.random.Generator, alpha: float = 2.0, tau: float = 5.0, sigma: float = 25.0
) -> np.ndarray:
    """Draw zero-mean Gaussian random fields ``N(0, sigma^2 (-Laplacian + tau^2 I)^-alpha)``.

    The defaults are the FNO paper's ``N(0, 625 (-Laplacian + 25 I)^-2)``. Sampling is done in
    Fourier space (see :func:`grf_from_normals`).

    Args:
        n_samples: Number of fields.
        grid_size: Points on the periodic grid ``x_j = j / grid_size``.
        rng: Source of randomness.
        alpha: Smoothness exponent.
        tau: Inverse length scale.
        sigma: Amplitude.

    Returns:
        ``[n_samples, grid_size]`` float64 array.
    """
    normals = rng.standard_normal((n_samples, grf_mode_count(grid_size), 2))
    return grf_from_normals(normals, grid_size, alpha=alpha, tau=tau, sigma=sigma)


# ---------------------------------------------------------------------------------------------
# Solver
# ---------------------------------------------------------------------------------------------


def etdrk4_coefficients(linear: np.ndarray, dt: float, n_contour: int = 32) -> tuple[np.ndarray, ...]:
    """ETDRK4 coefficients for a diagonal linear operator, by Kassam & Trefethen's contour mean.

    The phi-functions ``(e^z - 1)/z`` etc. cancel catastrophically near ``z = 0``; averaging them
    over a circle of radius 1 around each ``z = dt * L`` is accurate everywhere (K&T, SIAM J. Sci.
    Comput. 26(4), 2005). ``L`` is real here, so the upper half circle and the real part suffice.

    Returns:
        ``(E, E2, Q, f1, f2, f3)`` as in K&T's ``kdv.m``.
    """
    r = np.exp(1j * np.pi * (np.arange(1, n_contour + 1) - 0.5) / n_contour)
    lr = dt * linear[:, None] + r[None, :]
    exp_lr = np.exp(lr)
    q = dt * np.real(np.mean((np.exp(lr / 2) - 1) / lr, axis=1))
    f1 = dt * np.real(np.mean((-4 - lr + exp_lr * (4 - 3 * lr + lr**2)) / lr**3, axis=1))
    f2 = dt * np.real(np.mean((2 + lr + exp_lr * (-2 + lr)) / lr**3, axis=1))
    f3 = dt * np.real(np.mean((-4 - 3 * lr - lr**2 + exp_lr * (4 - lr)) / lr**3, axis=1))
    return np.exp(dt * linear), np.exp(dt * linear / 2), q, f1, f2, f3


def stable_time_step(u_max: float, viscosity: float, grid_size: int, dt_max: float = 1e-2) -> float:
    """A time step at which ETDRK4 on Burgers stays stable and accurate.

    Advection by speed ``u_max`` of mode ``k`` is stable while ``k u_max dt`` stays inside RK4's
    imaginary-axis limit (2.8; we use 1.5). Modes with ``nu k^2 dt >= 2`` are damped by the
    exponential integrator and need no such bound, so the step may be as large as
    ``nu / (2 u_max^2)``, where the two ranges meet; or as large as the advective bound of the
    highest kept (2/3-dealiased) mode, whichever is larger. ``dt_max`` caps it for accuracy.

    Args:
        u_max: Largest ``|u0|``; by the maximum principle it bounds ``|u|`` for all time.
        viscosity: ``nu``.
        grid_size: Points of the solve grid.
        dt_max: Upper bound.

    Returns:
        The time step.
    """
    if u_max <= 0.0:
        return dt_max
    k_max = 2.0 * np.pi * (grid_size // 3)
    advective = 1.5 / (k_max * u_max)
    viscous = viscosity / (2.0 * u_max**2)
    return float(min(dt_max, max(advective, viscous)))


def solve_burgers(
    u0: np.ndarray, viscosity: float = 0.1, t_final: float = 1.0, dt: float | None = None, n_snapshots: int = 0
) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Solve ``u_t + (u^2/2)_x = nu u_xx`` on periodic [0, 1) for a batch of initial conditions.

    Pseudo-spectral in space (real FFT, 2/3-rule dealiasing of the nonlinear term), ETDRK4 in time
    (Cox & Matthews 2002 with Kassam & Trefethen's coefficients), all in float64. The mean of ``u``
    is conserved exactly and the energy decays.

    Args:
        u0: ``[batch, n]`` or ``[n]`` initial values at ``x_j = j / n``, ``n`` even.
        viscosity: ``nu > 0``.
        t_final: End time.
        dt: Time step; ``None`` picks :func:`stable_time_step` from ``max |u0|``. The step is
            shrunk so that a whole number of steps (a multiple of ``n_snapshots``) ends at
            ``t_final``.
        n_snapshots: If positive, also return ``u`` at ``t_final * j / n_snapshots``, j = 1..n.

    Returns:
        ``u(t_final)`` with the shape of ``u0``; with snapshots, ``(u_final, snapshots, times)``
        where ``snapshots`` is ``[batch, n_snapshots, n]`` (``[n_snapshots, n]`` for 1-D input).
    """
    u = np.asarray(u0, dtype=np.float64)
    squeeze = u.ndim == 1
    u = np.atleast_2d(u)
    if u.ndim != 2:
        raise ValueError(f"u0 must be [batch, n] or [n], got shape {np.shape(u0)}")
    n = u.shape[-1]
    if n < 4 or n % 2:
        raise ValueError(f"grid size must be even and >= 4, got {n}")
    if viscosity <= 0:
        raise ValueError(f"viscosity must be > 0, got {viscosity}")
    if not np.all(np.isfinite(u)):
        raise ValueError("u0 contains NaN or inf")
    if dt is None:
        dt = stable_time_step(float(np.max(np.abs(u))), viscosity, n)
    per_snapshot = max(n_snapshots, 1)
    n_steps = per_snapshot * max(1, math.ceil(t_final / dt / per_snapshot - 1e-9))
    h = t_final / n_steps

    m = np.arange(n // 2 + 1)
    k = 2.0 * np.pi * m
    e, e2, q, f1, f2, f3 = etdrk4_coefficients(-viscosity * k**2, h)
    # d/dx of the Nyquist mode of a real signal is not representable: zero it, as is standard.
    k_deriv = np.where(m == n // 2, 0.0, k)
    dealias = m < n / 3.0
    g = -0.5j * k_deriv * dealias

    def nonlinear(v: np.ndarray) -> np.ndarray:
        return g * np.fft.rfft(np.fft.irfft(v, n=n, axis=-1) ** 2, axis=-1)

    v = np.fft.rfft(u, axis=-1)
    snapshots = []
    steps_per_snapshot = n_steps // per_snapshot
    for step in range(1, n_steps + 1):
        nv = nonlinear(v)
        a = e2 * v + q * nv
        na = nonlinear(a)
        b = e2 * v + q * na
        nb = nonlinear(b)
        c = e2 * a + q * (2 * nb - nv)
        nc = nonlinear(c)
        v = e * v + nv * f1 + 2 * (na + nb) * f2 + nc * f3
        if n_snapshots and step % steps_per_snapshot == 0:
            snapshots.append(np.fft.irfft(v, n=n, axis=-1))

    out = np.fft.irfft(v, n=n, axis=-1)
    if squeeze:
        out = out[0]
    if not n_snapshots:
        return out
    snaps = np.stack(snapshots, axis=1)
    times = t_final * np.arange(1, n_snapshots + 1) / n_snapshots
    return out, (snaps[0] if squeeze else snaps), times


def cole_hopf_solution(u0: np.ndarray, viscosity: float, t: float) -> np.ndarray:
    """Exact Burgers solution at time ``t`` by the Cole-Hopf transform, for band-limited ``u0``.

    With ``phi0 = exp(-U0 / (2 nu))``, ``U0' = u0``, the heat equation ``phi_t = nu phi_xx`` is
    solved exactly in Fourier space and ``u = -2 nu phi_x / phi``. The only error is aliasing of
    ``phi0``'s spectrum on the grid, which is at round-off when ``|U0| / nu`` is moderate (e.g. a
    few low modes at ``nu = 0.1``); for small ``nu`` use a finer grid or another reference.

    Args:
        u0: ``[..., n]`` zero-mean initial values at ``x_j = j / n`` (a zero mean keeps ``U0``
            periodic).
        viscosity: ``nu > 0``.
        t: Time.

    Returns:
        ``u(x_j, t)``, same shape as ``u0``, float64.
    """
    u0 = np.asarray(u0, dtype=np.float64)
    n = u0.shape[-1]
    u0_hat = np.fft.rfft(u0, axis=-1)
    if np.max(np.abs(u0_hat[..., 0])) / n > 1e-12 * max(1.0, float(np.max(np.abs(u0)))):
        raise ValueError("cole_hopf_solution needs a zero-mean u0 (shift it: Burgers is Galilean-invariant)")
    k = 2.0 * np.pi * np.arange(n // 2 + 1)
    k_deriv = np.where(np.arange(n // 2 + 1) == n // 2, 0.0, k)
    # Antiderivative of u0 in Fourier space; the constant is arbitrary (it cancels in phi_x / phi).
    inverse_deriv = np.zeros(n // 2 + 1, dtype=np.complex128)
    inverse_deriv[k_deriv != 0] = 1.0 / (1j * k_deriv[k_deriv != 0])
    big_u_hat = u0_hat * inverse_deriv
    big_u = np.fft.irfft(big_u_hat, n=n, axis=-1)
    # Subtracting the minimum keeps exp() in range; it is another arbitrary constant.
    exponent = -(big_u - np.min(big_u, axis=-1, keepdims=True)) / (2.0 * viscosity)
    phi_hat = np.fft.rfft(np.exp(exponent - np.max(exponent, axis=-1, keepdims=True)), axis=-1)
    phi_hat = phi_hat * np.exp(-viscosity * k**2 * t)
    phi = np.fft.irfft(phi_hat, n=n, axis=-1)
    phi_x = np.fft.irfft(1j * k_deriv * phi_hat, n=n, axis=-1)
    return -2.0 * viscosity * phi_x / phi


def cole_hopf_quadrature(u0: np.ndarray, viscosity: float, t: float, out_points: int) -> np.ndarray:
    """Exact Burgers solution at any viscosity: the Cole-Hopf formula as a heat-kernel integral, in log space.

    ``u(x, t) = int (x - y) / t w(x, y) dy / int w(x, y) dy`` with ``w = exp(-G / (2 nu))`` and
    ``G = (x - y)^2 / (2 t) + U0(y)``, ``U0' = u0``, over the real line (``U0`` is periodic for a zero-mean
    ``u0``). Each ``x`` divides its weights by their largest one, so nothing under- or overflows: at
    ``nu = 1e-3`` :func:`cole_hopf_solution`'s ``exp(-U0 / (2 nu))`` leaves float64's range. The trapezoid
    rule on the points of ``u0`` converges spectrally for this smooth periodic integrand, so a fine ``u0``
    (e.g. 4,096 points of a band-limited field at ``nu = 1e-3``) gives the solution to round-off. An
    independent reference for :func:`solve_burgers` (no time stepping at all).

    Args:
        u0: ``[batch, n]`` zero-mean initial values at ``x_j = j / n``: the quadrature points.
        viscosity: ``nu > 0``.
        t: Time ``> 0``.
        out_points: Points ``x_i = i / out_points`` of the result; must divide ``n``.

    Returns:
        ``[batch, out_points]`` float64.
    """
    u0 = np.atleast_2d(np.asarray(u0, dtype=np.float64))
    n = u0.shape[-1]
    if n % out_points:
        raise ValueError(f"out_points {out_points} must divide the {n} quadrature points")
    if np.max(np.abs(u0.mean(axis=-1))) > 1e-12 * max(1.0, float(np.max(np.abs(u0)))):
        raise ValueError("cole_hopf_quadrature needs a zero-mean u0 (shift it: Burgers is Galilean-invariant)")
    m = np.arange(n // 2 + 1)
    inverse_deriv = np.zeros(n // 2 + 1, dtype=np.complex128)
    inverse_deriv[1 : (n + 1) // 2] = 1.0 / (2j * np.pi * m[1 : (n + 1) // 2])  # no Nyquist, no mean
    big_u = np.fft.irfft(np.fft.rfft(u0, axis=-1) * inverse_deriv, n=n, axis=-1)
    # Periods each side: beyond them the Gaussian factor is below e^-40 of the best weight.
    spread = float(np.max(big_u.max(axis=-1) - big_u.min(axis=-1)))
    periods = math.ceil(math.sqrt(4.0 * viscosity * t * (40.0 + spread / (2.0 * viscosity))))
    y = np.arange(-periods * n, (periods + 1) * n) / n
    x = np.arange(out_points) / out_points
    out = np.empty((u0.shape[0], out_points))
    for b in range(u0.shape[0]):
        big_u_y = np.tile(big_u[b], 2 * periods + 1)
        for start in range(0, out_points, 64):  # chunks bound the [x, y] work array
            offset = x[start : start + 64, None] - y[None, :]
            log_w = -(offset**2 / (2.0 * t) + big_u_y[None, :]) / (2.0 * viscosity)
            w = np.exp(log_w - log_w.max(axis=1, keepdims=True))
            out[b, start : start + 64] = (w * offset).sum(axis=1) / (w.sum(axis=1) * t)
    return out


def refinement_error(
    n_samples: int,
    viscosity: float,
    solve_grid: int = DEFAULT_SOLVE_GRID,
    seed: int = 0,
    t_final: float = 1.0,
    alpha: float = 2.0,
    tau: float = 5.0,
    sigma: float = 25.0,
) -> dict[str, Any]:
    """The solver's own error: the dataset's first test samples solved as the dataset does, then at twice the
    resolution with half the time step, compared on the dataset's points.

    The finer run gets the same initial condition (the same Fourier modes, evaluated on twice the points), and
    the step the dataset would use for these samples, halved.

    Returns:
        ``{"rel_l2_max", "rel_l2_mean"}`` over the samples, the grids and steps of both runs, and
        ``"steepest_front_points"``: the narrowest front of ``u(T)`` (its jump over its largest slope) in grid
        spacings - how many points resolve a shock.
    """
    normals = _normals(n_samples, 1, seed, grf_mode_count(solve_grid))
    u0 = grf_from_normals(normals, solve_grid, alpha=alpha, tau=tau, sigma=sigma)
    u0_fine = grf_from_normals(normals, 2 * solve_grid, alpha=alpha, tau=tau, sigma=sigma)
    dt = stable_time_step(float(np.max(np.abs(u0))), viscosity, solve_grid)
    coarse = solve_burgers(u0, viscosity=viscosity, t_final=t_final, dt=dt)
    fine = solve_burgers(u0_fine, viscosity=viscosity, t_final=t_final, dt=dt / 2)[:, ::2]
    errors = np.linalg.norm(coarse - fine, axis=1) / np.linalg.norm(fine, axis=1)
    slope = np.max(np.abs(np.diff(fine, axis=1, append=fine[:, :1])), axis=1)  # per grid spacing
    jump = fine.max(axis=1) - fine.min(axis=1)
    return {
        "rel_l2_max": float(errors.max()),
        "rel_l2_mean": float(errors.mean()),
        "n_samples": int(n_samples),
        "viscosity": float(viscosity),
        "grid": int(solve_grid),
        "dt": float(dt),
        "fine_grid": int(2 * solve_grid),
        "fine_dt": float(dt / 2),
        "steepest_front_points": float(np.min(jump / slope)),
    }


# ---------------------------------------------------------------------------------------------
# Dataset generation and cache
# ---------------------------------------------------------------------------------------------


def _normals(n: int, split: int, seed: int, n_modes: int) -> np.ndarray:
    """``[n, n_modes, 2]`` standard normals; sample ``i`` comes from its own stream ``(seed, split, i)``.

    Per-sample streams make the data independent of chunking and worker count, keep the test set
    fixed when ``n_train`` changes, and (normals drawn mode-major) give the same low modes at any
    solve grid.
    """
    if n == 0:
        return np.zeros((0, n_modes, 2))
    return np.stack([np.random.default_rng([seed, split, i]).standard_normal((n_modes, 2)) for i in range(n)])


def _initial_conditions(
    n: int, split: int, seed: int, solve_grid: int, alpha: float, tau: float, sigma: float
) -> np.ndarray:
    """``n`` fields of one split on ``solve_grid`` points (see :func:`_normals`)."""
    normals = _normals(n, split, seed, grf_mode_count(solve_grid))
    return grf_from_normals(normals, solve_grid, alpha=alpha, tau=tau, sigma=sigma)


def _solve_chunk(args: tuple[np.ndarray, float, float, float]) -> np.ndarray:
    """Process-pool task: one chunk of initial conditions -> float32 solutions."""
    u0, viscosity, t_final, dt = args
    return np.asarray(solve_burgers(u0, viscosity=viscosity, t_final=t_final, dt=dt), dtype=np.float32)


def _solve_all(
    u0: np.ndarray,
    viscosity: float,
    t_final: float,
    dt: float,
    workers: int,
    chunk_size: int,
    progress: ProgressFn | None,
) -> np.ndarray:
    """Solve all rows of ``u0`` in chunks (small chunks keep the FFT working set in cache)."""
    tasks = [(u0[i : i + chunk_size], viscosity, t_final, dt) for i in range(0, len(u0), chunk_size)]
    done, total, results = 0, len(u0), []
    if workers <= 1 or len(tasks) == 1:
        for task in tasks:
            results.append(_solve_chunk(task))
            done += len(task[0])
            if progress:
                progress(done, total)
    else:
        # spawn, not fork: the parent may hold torch/OpenMP threads, which fork does not survive.
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            for task, result in zip(tasks, pool.map(_solve_chunk, tasks), strict=True):
                results.append(result)
                done += len(task[0])
                if progress:
                    progress(done, total)
    return np.concatenate(results) if results else np.zeros((0, u0.shape[-1]), np.float32)


def _cache_params(
    n_train: int,
    n_test: int,
    solve_grid: int,
    viscosity: float,
    t_final: float,
    dt: float | None,
    alpha: float,
    tau: float,
    sigma: float,
    seed: int,
) -> dict[str, Any]:
    """Everything that determines the cached numbers (not ``grid_size``: we subsample on load)."""
    return {
        "version": DATA_VERSION,
        "n_train": int(n_train),
        "n_test": int(n_test),
        "solve_grid": int(solve_grid),
        "viscosity": float(viscosity),
        "t_final": float(t_final),
        "dt": None if dt is None else float(dt),
        "alpha": float(alpha),
        "tau": float(tau),
        "sigma": float(sigma),
        "seed": int(seed),
    }


def cache_path(cache_dir: str | os.PathLike[str] | None, params: dict[str, Any]) -> Path:
    """Cache file for ``params``: a readable name plus a hash of all parameters."""
    digest = params_digest(params)
    name = (
        f"burgers_nu{params['viscosity']:g}_n{params['n_train']}+{params['n_test']}"
        f"_grid{params['solve_grid']}_seed{params['seed']}_{digest}.npz"
    )
    return Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser() / name


def subsample(u: np.ndarray, grid_size: int) -> np.ndarray:
    """Take every ``n / grid_size``-th point of ``[..., n]`` values (exact for point samples)."""
    n = u.shape[-1]
    if grid_size <= 0 or n % grid_size:
        raise DataError(f"grid_size {grid_size} must divide the solve grid {n} (use a power of two, e.g. 256)")
    return u[..., :: n // grid_size]


def generate_dataset(
    n_train: int,
    n_test: int,
    grid_size: int,
    viscosity: float = 0.1,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    workers: int = 1,
    *,
    solve_grid: int = DEFAULT_SOLVE_GRID,
    t_final: float = 1.0,
    dt: float | None = None,
    alpha: float = 2.0,
    tau: float = 5.0,
    sigma: float = 25.0,
    use_cache: bool = True,
    chunk_size: int = 100,
    progress: ProgressFn | bool | None = None,
) -> dict[str, Any]:
    """Burgers pairs ``u0 -> u(t_final)``, deterministic by ``seed``, cached as ``.npz``.

    Fields are drawn and solved on ``solve_grid`` points (``grid_size`` if larger) and subsampled
    to ``grid_size``. The cache holds the solve-grid arrays, so the same samples at another
    resolution - e.g. 4x ``grid_size`` for zero-shot super-resolution - come from calling again
    with another ``grid_size`` (a cache hit). Sample ``i`` of each split has its own random stream,
    so the data do not depend on ``workers`` or ``chunk_size``, and the test set does not change
    with ``n_train``.

    Args:
        n_train: Training pairs.
        n_test: Test pairs.
        grid_size: Points per sample returned; must divide ``solve_grid``.
        viscosity: ``nu``; 0.1 is the paper's text, 1e-3 its public generator (see
            ``PUBLIC_GENERATOR`` for the field that goes with it).
        seed: Seed of all randomness.
        cache_dir: Folder of the cache; default ``~/.cache/zero-recipes/burgers``.
        workers: Processes for solving (1: in this process). More than one uses the ``spawn``
            start method (safe next to torch's threads), so a calling script needs the
            ``if __name__ == "__main__":`` guard.
        solve_grid: Grid of the solver.
        t_final: End time ``T``.
        dt: Solver time step; ``None`` picks a stable one from the largest ``|u0|`` of the dataset.
        alpha: GRF smoothness exponent.
        tau: GRF inverse length scale.
        sigma: GRF amplitude.
        use_cache: Read and write the cache.
        chunk_size: Samples per solver call.
        progress: ``callback(done, total)``, or ``True`` for a tqdm bar.

    Returns:
        ``{"x_train", "y_train", "x_test", "y_test"}`` float32 arrays ``[N, grid_size]`` and
        ``"meta"``: a JSON-able dict of the parameters, the time step used, the cache path and
        whether it was a cache hit.

    Raises:
        DataError: For impossible parameters.
    """
    if n_train < 1 or n_test < 0:
        raise DataError(f"need n_train >= 1 and n_test >= 0, got n_train={n_train}, n_test={n_test}")
    if viscosity <= 0:
        raise DataError(f"viscosity must be > 0, got {viscosity}")
    solve_grid = max(int(solve_grid), int(grid_size))
    if solve_grid % 2 or solve_grid % grid_size:
        raise DataError(f"grid_size {grid_size} must divide solve_grid {solve_grid} (use powers of two)")
    params = _cache_params(n_train, n_test, solve_grid, viscosity, t_final, dt, alpha, tau, sigma, seed)
    path = cache_path(cache_dir, params)

    shapes = {
        "x_train": (n_train, solve_grid),
        "y_train": (n_train, solve_grid),
        "x_test": (n_test, solve_grid),
        "y_test": (n_test, solve_grid),
    }
    cached = read_cached_arrays(path, params, shapes, logger) if use_cache else None
    if cached is None:
        start = time.perf_counter()
        x_train = _initial_conditions(n_train, 0, seed, solve_grid, alpha, tau, sigma)
        x_test = _initial_conditions(n_test, 1, seed, solve_grid, alpha, tau, sigma)
        u0 = np.concatenate([x_train, x_test])
        # One step for the whole dataset (from its largest |u0|), so chunking cannot change the numbers.
        dt_used = dt if dt is not None else stable_time_step(float(np.max(np.abs(u0))), viscosity, solve_grid)
        close = None
        if progress is True:
            progress, close = progress_bar(len(u0), "burgers")
        try:
            y = _solve_all(u0, viscosity, t_final, dt_used, workers, chunk_size, progress or None)
        finally:
            if close:
                close()
        arrays = {
            "x_train": x_train.astype(np.float32),
            "y_train": y[:n_train],
            "x_test": x_test.astype(np.float32),
            "y_test": y[n_train:],
        }
        meta = {"params": params, "dt_used": dt_used, "generation_seconds": time.perf_counter() - start}
        if use_cache:
            write_npz_atomic(path, arrays, meta)
        cached = {**arrays, "meta": meta}
        cache_hit = False
    else:
        cache_hit = True

    out = {key: subsample(cached[key], grid_size) for key in ("x_train", "y_train", "x_test", "y_test")}
    out["meta"] = {
        **cached["meta"],
        "grid_size": int(grid_size),
        "cache_path": str(path) if use_cache else None,
        "cache_hit": cache_hit,
    }
    return out


# ---------------------------------------------------------------------------------------------
# Users' own data
# ---------------------------------------------------------------------------------------------


def _as_samples_by_grid(name: str, array: np.ndarray, path: Path, n_dims: int = 1) -> np.ndarray:
    """Accept ``[N, *grid]`` or ``[N, *grid, 1]`` with ``n_dims`` grid axes; anything else is a :class:`DataError`."""
    if array.ndim == n_dims + 2 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim != n_dims + 1:
        grid = "grid" if n_dims == 1 else ", ".join(["n"] * n_dims)
        other = array.ndim - 1  # the grid axes it does have, if it was meant for another model
        hint = f" (functions on a {other}-D grid: the science recipe's model=fno{other}d)" if other in (1, 2) else ""
        raise DataError(
            f"{path}: array '{name}' must have shape [N, {grid}] or [N, {grid}, 1], got {array.shape}{hint}"
        )
    if not np.issubdtype(array.dtype, np.number) or np.iscomplexobj(array):
        raise DataError(f"{path}: array '{name}' must be real numbers, got dtype {array.dtype}")
    return array


def load_npz_dataset(
    path: str | os.PathLike[str], val_fraction: float = 0.2, seed: int = 0, n_dims: int = 1
) -> dict[str, Any]:
    """Load users' pairs from an ``.npz`` with arrays ``x`` (inputs) and ``y`` (targets).

    Both are ``[N, grid]`` (or ``[N, grid, 1]``) on a uniform periodic grid, or with ``n_dims=2``
    ``[N, nx, ny]`` (or ``[N, nx, ny, 1]``) on the nodes of the unit square; the split is a seeded
    permutation. The held-out part is returned under the ``*_test`` keys so that the result is a
    drop-in for :func:`generate_dataset`.

    Args:
        path: The ``.npz`` file.
        val_fraction: Share of samples held out, in (0, 1); at least one sample goes to each side.
        seed: Seed of the split.
        n_dims: Grid axes of each function (1 or 2).

    Returns:
        ``{"x_train", "y_train", "x_test", "y_test"}`` float32 arrays and ``"meta"``.

    Raises:
        DataError: With a message naming the problem (missing file or array, shapes, NaN/inf, too
            few samples).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data file not found: {path} (expected an .npz with arrays 'x' and 'y')")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            if not isinstance(npz, np.lib.npyio.NpzFile):
                raise DataError(f"{path}: expected an .npz archive with arrays 'x' and 'y', got a single .npy array")
            missing = [name for name in ("x", "y") if name not in npz.files]
            if missing:
                raise DataError(
                    f"{path}: missing array(s) {', '.join(repr(m) for m in missing)}; "
                    f"found {sorted(npz.files)}. Save with np.savez(path, x=inputs, y=targets)"
                )
            x, y = np.asarray(npz["x"]), np.asarray(npz["y"])
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from exc

    x, y = _as_samples_by_grid("x", x, path, n_dims), _as_samples_by_grid("y", y, path, n_dims)
    if x.shape != y.shape:
        raise DataError(f"{path}: 'x' and 'y' must have the same shape, got x {x.shape} and y {y.shape}")
    for name, array in (("x", x), ("y", y)):
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        if bad:
            raise DataError(f"{path}: array '{name}' has {bad} NaN or inf value(s)")
    n = x.shape[0]
    if n < 2:
        raise DataError(f"{path}: need at least 2 samples (one to train, one to validate), got {n}")

    n_val = min(n - 1, max(1, round(n * val_fraction)))
    order = np.random.default_rng(seed).permutation(n)
    val_idx, train_idx = order[:n_val], order[n_val:]
    return {
        "x_train": x[train_idx].astype(np.float32),
        "y_train": y[train_idx].astype(np.float32),
        "x_test": x[val_idx].astype(np.float32),
        "y_test": y[val_idx].astype(np.float32),
        "meta": {"source": str(path), "n_samples": n, "grid_size": int(x.shape[1]), "val_fraction": val_fraction},
    }
