"""Darcy flow data: the solver against a manufactured solution, the stencil, the paper's field, the dataset."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.fft

from science import darcy
from science.cache import DataError
from science.darcy import (
    assemble_operator,
    generate_dataset,
    grf_amplitudes,
    grf_at,
    grf_from_normals,
    refinement_error,
    solve_darcy,
)

# Small everywhere: these run on a shared 2-core machine.
SMALL = {"n_train": 4, "n_test": 2, "grid_size": 9, "solve_grid": 17, "grf_modes": 24}


# --- solver -------------------------------------------------------------------------------------


def manufactured(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``a``, ``f = -div(a grad u)`` and ``u`` at the nodes of a ``k x k`` grid, by hand-derived formulas.

    ``u = sin(pi x) sin(pi y) (1 + x y)`` (zero on the boundary), ``a = 2 + sin(2 pi x) cos(pi y)``.
    """
    nodes = np.arange(k) / (k - 1)
    x, y = np.meshgrid(nodes, nodes, indexing="ij")
    sx, cx, sy, cy = np.sin(np.pi * x), np.cos(np.pi * x), np.sin(np.pi * y), np.cos(np.pi * y)
    a = 2 + np.sin(2 * np.pi * x) * cy
    a_x, a_y = 2 * np.pi * np.cos(2 * np.pi * x) * cy, -np.pi * np.sin(2 * np.pi * x) * sy
    u = sx * sy * (1 + x * y)
    u_x = np.pi * cx * sy * (1 + x * y) + sx * sy * y
    u_y = np.pi * sx * cy * (1 + x * y) + sx * sy * x
    u_xx = -(np.pi**2) * u + 2 * np.pi * cx * sy * y
    u_yy = -(np.pi**2) * u + 2 * np.pi * sx * cy * x
    f = -(a_x * u_x + a_y * u_y + a * (u_xx + u_yy))
    return a, f, u


def test_solver_converges_to_a_manufactured_solution_at_second_order():
    errors = []
    for k in (17, 33, 65, 129):
        a, f, exact = manufactured(k)
        u = solve_darcy(a, f)
        assert np.all(u[0] == 0) and np.all(u[-1] == 0) and np.all(u[:, 0] == 0) and np.all(u[:, -1] == 0)
        errors.append(np.max(np.abs(u - exact)))
    ratios = [coarse / fine for coarse, fine in zip(errors, errors[1:])]
    assert all(3.6 < r < 4.4 for r in ratios), ratios  # halving h divides the error by 4
    assert errors[-1] < 1e-4


def test_stencil_equals_a_matrix_built_node_by_node():
    """The vectorised assembly against the scheme written out one interior node at a time."""
    rng = np.random.default_rng(0)
    k = 6
    a = rng.uniform(1.0, 5.0, (k, k))
    n = k - 2
    dense = np.zeros((n * n, n * n))
    for i in range(1, k - 1):
        for j in range(1, k - 1):
            row = (i - 1) * n + (j - 1)
            for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                face = (a[i, j] + a[i + di, j + dj]) / 2
                dense[row, row] += face
                if 1 <= i + di <= k - 2 and 1 <= j + dj <= k - 2:
                    dense[row, (i + di - 1) * n + (j + dj - 1)] -= face
    np.testing.assert_allclose(assemble_operator(a).toarray(), dense * (k - 1) ** 2, rtol=1e-14)


def test_conjugate_gradients_agree_with_a_direct_solve_on_a_thresholded_field():
    normals = np.random.default_rng(3).standard_normal((1, 64, 64))
    a = darcy.threshold(grf_from_normals(normals, 65)[0])
    assert set(np.unique(a)) == {3.0, 12.0}
    iterative, direct = solve_darcy(a), solve_darcy(a, method="direct")
    assert np.linalg.norm(iterative - direct) / np.linalg.norm(direct) < 1e-9
    assert np.all(iterative[1:-1, 1:-1] > 0)  # f = 1 > 0: the maximum principle


def test_solver_refuses_bad_coefficients():
    with pytest.raises(ValueError, match="positive"):
        solve_darcy(np.zeros((5, 5)))
    with pytest.raises(ValueError, match="square"):
        solve_darcy(np.ones((5, 6)))
    with pytest.raises(ValueError, match="method"):
        solve_darcy(np.ones((5, 5)), method="lu")


# --- the paper's coefficient field ----------------------------------------------------------------


def test_field_is_the_paper_grf_m_at_its_cell_centres():
    """The paper's ``GRF.m``: ``idct2(s * coef .* xi)`` on s x s cell centres, ``coef(1, 1) = 0``."""
    s, alpha, tau = 16, 2.0, 3.0
    xi = np.random.default_rng(1).standard_normal((s, s))
    k1, k2 = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    coef = tau ** (alpha - 1) * (np.pi**2 * (k1**2 + k2**2) + tau**2) ** (-alpha / 2)
    coef[0, 0] = 0.0
    paper = scipy.fft.idctn(s * coef * xi, norm="ortho")  # MATLAB's idct2 is the orthonormal DCT-III
    ours = grf_at(xi[None], (np.arange(s) + 0.5) / s, alpha=alpha, tau=tau)[0]
    np.testing.assert_allclose(ours, paper, atol=1e-12)
    assert grf_amplitudes(s)[0, 0] == 0.0


def test_any_grid_samples_the_same_field():
    normals = np.random.default_rng(2).standard_normal((2, 30, 30))
    np.testing.assert_allclose(grf_from_normals(normals, 33)[:, ::4, ::4], grf_from_normals(normals, 9), atol=1e-12)


# --- generated dataset --------------------------------------------------------------------------


def test_dataset_pairs_are_solutions_on_the_solve_grid_subsampled():
    data = generate_dataset(**SMALL, use_cache=False)
    params = data["meta"]["params"]
    for key in ("x_train", "y_train", "x_test", "y_test"):
        assert data[key].shape == (SMALL["n_train"] if "train" in key else SMALL["n_test"], 9, 9)
        assert data[key].dtype == np.float32
    a = darcy.coefficient(0, 1, params)  # the second training sample on the 17-node solve grid
    np.testing.assert_array_equal(data["x_train"][1], a[::2, ::2])
    np.testing.assert_allclose(data["y_train"][1], solve_darcy(a)[::2, ::2], rtol=1e-6)
    assert set(np.unique(data["x_train"])) <= {3.0, 12.0}


def test_dataset_is_deterministic_by_seed_and_its_test_set_independent_of_n_train():
    a = generate_dataset(**SMALL, seed=1, use_cache=False)
    b = generate_dataset(**SMALL, seed=1, use_cache=False, chunk_size=1)
    c = generate_dataset(**SMALL, seed=2, use_cache=False)
    d = generate_dataset(**{**SMALL, "n_train": 1}, seed=1, use_cache=False)
    for key in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(a[key], b[key])
        assert not np.array_equal(a[key], c[key])
    np.testing.assert_array_equal(d["y_test"], a["y_test"])


def test_dataset_with_two_workers_equals_one_worker():
    one = generate_dataset(**SMALL, use_cache=False, chunk_size=2)
    two = generate_dataset(**SMALL, use_cache=False, chunk_size=2, workers=2)
    np.testing.assert_array_equal(one["y_train"], two["y_train"])
    np.testing.assert_array_equal(one["y_test"], two["y_test"])


def test_cache_hit_does_not_solve_again_and_records_parameters(tmp_path, forbid):
    calls = []
    first = generate_dataset(**SMALL, cache_dir=tmp_path, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (6, 6) and not first["meta"]["cache_hit"]
    forbid(darcy, "solve_darcy", "a cache hit must not run the solver")
    second = generate_dataset(**SMALL, cache_dir=tmp_path)
    assert second["meta"]["cache_hit"]
    np.testing.assert_array_equal(first["y_test"], second["y_test"])
    with np.load(second["meta"]["cache_path"]) as npz:
        assert json.loads(str(npz["meta"]))["params"]["solve_grid"] == 17
    assert [p.suffix for p in tmp_path.iterdir()] == [".npz"]  # no temporary files left
    with pytest.raises(AssertionError, match="must not run"):  # other parameters: another file, a solve
        generate_dataset(**{**SMALL, "solve_grid": 33}, cache_dir=tmp_path)


def test_corrupt_cache_is_regenerated(tmp_path, caplog):
    first = generate_dataset(**SMALL, cache_dir=tmp_path)
    with open(first["meta"]["cache_path"], "wb") as fh:
        fh.write(b"not a zip file")
    again = generate_dataset(**SMALL, cache_dir=tmp_path)
    assert not again["meta"]["cache_hit"] and "regenerating" in caplog.text
    np.testing.assert_array_equal(again["y_train"], first["y_train"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"solve_grid": 20}, "must divide"),
        ({"grid_size": 2, "solve_grid": 2}, "grid_size >= 3"),
        ({"n_train": 0}, "n_train >= 1"),
        ({"low": 0.0}, "positive"),
    ],
)
def test_impossible_parameters_are_a_data_error(override, message):
    with pytest.raises(DataError, match=message):
        generate_dataset(**{**SMALL, **override}, use_cache=False)


def test_refinement_error_is_small_and_reported_with_its_grids():
    report = refinement_error(2, grid_size=9, solve_grid=17, grf_modes=24)
    assert report["fine_grid"] == 33 and report["solve_grid"] == 17
    assert 0 < report["rel_l2_max"] < 0.05
