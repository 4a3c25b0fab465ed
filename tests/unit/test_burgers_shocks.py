"""Burgers at viscosity 1e-3 (the FNO paper's public generator): the solver resolves the shocks.

The reference is independent of the solver: the Cole-Hopf formula evaluated as a heat-kernel integral
(no time stepping, no dealiasing), converged to round-off on a 4x finer quadrature grid.
"""

from __future__ import annotations

import numpy as np
import pytest

from science.burgers import (
    PUBLIC_GENERATOR,
    cole_hopf_quadrature,
    cole_hopf_solution,
    grf_from_normals,
    grf_mode_count,
    refinement_error,
    sample_grf,
    solve_burgers,
)

NU = PUBLIC_GENERATOR["viscosity"]
FIELD = {key: PUBLIC_GENERATOR[key] for key in ("alpha", "tau", "sigma")}


def relative_l2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def normals() -> np.ndarray:
    """Three initial conditions of the public generator's field, band-limited to a 1,024-point grid."""
    return np.random.default_rng(7).standard_normal((3, grf_mode_count(1024), 2))


@pytest.fixture(scope="module")
def exact(normals) -> np.ndarray:
    """u(x, 1) at 1,024 points from the Cole-Hopf integral on 4,096 quadrature points."""
    return cole_hopf_quadrature(grf_from_normals(normals, 4096, **FIELD), NU, 1.0, out_points=1024)


def test_quadrature_reference_is_converged(normals, exact):
    coarser = cole_hopf_quadrature(grf_from_normals(normals, 2048, **FIELD), NU, 1.0, out_points=1024)
    assert relative_l2(coarser, exact).max() < 1e-12


def test_quadrature_reference_equals_the_spectral_cole_hopf_where_both_work():
    # At viscosity 0.1 cole_hopf_solution is exact to round-off (test_science_data checks it).
    u0 = sample_grf(2, 512, np.random.default_rng(1))
    np.testing.assert_allclose(
        cole_hopf_quadrature(u0, 0.1, 1.0, out_points=128), cole_hopf_solution(u0, 0.1, 1.0)[:, ::4], atol=1e-12
    )


def test_solution_has_shocks(exact):
    """Fronts a few grid spacings of 1,024 wide: a 256-point grid cannot carry them (the refinement test)."""
    slope = np.abs(np.diff(exact, axis=1)).max(axis=1)
    front_points = (exact.max(axis=1) - exact.min(axis=1)) / slope
    assert front_points.min() < 20


def test_solver_converges_under_refinement_to_the_exact_solution(normals, exact):
    errors = {}
    for grid in (256, 512, 1024):
        u = solve_burgers(grf_from_normals(normals, grid, **FIELD), viscosity=NU)
        errors[grid] = relative_l2(u[:, :: grid // 256], exact[:, ::4]).max()
    assert errors[256] > 1e-4  # the shocks are not resolved on 256 points ...
    assert errors[512] < errors[256] / 10
    assert errors[1024] < errors[512] / 10
    assert errors[1024] < 1e-7  # ... and are on the dataset's 1,024 points


def test_dataset_grid_agrees_with_twice_the_resolution_and_half_the_step():
    report = refinement_error(4, NU, solve_grid=1024, **FIELD)
    assert report["fine_grid"] == 2048 and report["fine_dt"] == report["dt"] / 2
    assert report["rel_l2_max"] < 1e-6
    assert report["steepest_front_points"] < 20


def test_quadrature_refuses_a_nonzero_mean_and_a_grid_it_cannot_sample():
    u0 = np.sin(2 * np.pi * np.arange(64) / 64)
    with pytest.raises(ValueError, match="zero-mean"):
        cole_hopf_quadrature(u0 + 0.5, NU, 1.0, out_points=64)
    with pytest.raises(ValueError, match="must divide"):
        cole_hopf_quadrature(u0, NU, 1.0, out_points=48)
