"""Burgers data: solver accuracy and invariants, GRF statistics, dataset determinism, cache, user files."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from science import burgers
from science.burgers import (
    DataError,
    cole_hopf_solution,
    generate_dataset,
    load_npz_dataset,
    sample_grf,
    solve_burgers,
)

# Small everywhere: these run on a shared 2-core machine.
SMALL = {"n_train": 6, "n_test": 3, "grid_size": 64, "solve_grid": 256}


def grid(n: int) -> np.ndarray:
    return np.arange(n) / n


# --- solver -------------------------------------------------------------------------------------


def test_cole_hopf_reference_is_resolved():
    """The reference itself: the same answer on a 4x finer grid."""
    coarse = cole_hopf_solution(np.sin(2 * np.pi * grid(128)), 0.1, 1.0)
    fine = cole_hopf_solution(np.sin(2 * np.pi * grid(512)), 0.1, 1.0)
    np.testing.assert_allclose(coarse, fine[::4], atol=1e-13)


def test_solver_matches_cole_hopf_for_a_sine():
    u0 = np.sin(2 * np.pi * grid(256))
    exact = cole_hopf_solution(u0, 0.1, 1.0)
    u = solve_burgers(u0, viscosity=0.1, t_final=1.0, dt=1e-3)
    assert u.shape == u0.shape
    assert np.max(np.abs(u - exact)) < 1e-10


def test_solver_matches_cole_hopf_for_grf_batch_with_automatic_step():
    u0 = sample_grf(4, 256, np.random.default_rng(3))
    exact = cole_hopf_solution(u0, 0.1, 1.0)
    u = solve_burgers(u0, viscosity=0.1)
    assert np.max(np.abs(u - exact)) < 1e-5
    # Relative to the solution's size too: u(T) is small at this viscosity.
    assert np.max(np.abs(u - exact)) / np.max(np.abs(exact)) < 1e-4


def test_mean_is_conserved_and_energy_decays():
    u0 = sample_grf(3, 128, np.random.default_rng(0)) + 0.3  # a nonzero mean must survive exactly
    u, snaps, times = solve_burgers(u0, viscosity=0.1, t_final=0.5, n_snapshots=5)
    assert snaps.shape == (3, 5, 128)
    np.testing.assert_allclose(times, [0.1, 0.2, 0.3, 0.4, 0.5])
    np.testing.assert_array_equal(snaps[:, -1], u)
    np.testing.assert_allclose(snaps.mean(axis=-1), np.repeat(u0.mean(axis=-1, keepdims=True), 5, axis=1), atol=1e-12)
    fluctuation = snaps - snaps.mean(axis=-1, keepdims=True)
    energy = np.concatenate([[np.sum((u0 - u0.mean(-1, keepdims=True)) ** 2, -1)], np.sum(fluctuation**2, -1).T])
    assert np.all(np.diff(energy, axis=0) < 0)


def test_solver_accepts_1d_input_and_rejects_bad_arguments():
    u0 = np.sin(2 * np.pi * grid(64))
    assert solve_burgers(u0, t_final=0.1).shape == (64,)
    with pytest.raises(ValueError, match="even"):
        solve_burgers(np.zeros((2, 63)))
    with pytest.raises(ValueError, match="viscosity"):
        solve_burgers(u0, viscosity=0.0)
    with pytest.raises(ValueError, match="NaN"):
        solve_burgers(np.full(64, np.nan))


# --- Gaussian random field ----------------------------------------------------------------------


def test_grf_has_zero_mean_and_the_paper_covariance():
    fields = sample_grf(2000, 64, np.random.default_rng(0))
    assert fields.shape == (2000, 64)
    np.testing.assert_allclose(fields.mean(axis=1), 0.0, atol=1e-12)  # the mean mode is zero, as in GRF1.m
    k = np.arange(1, burgers.grf_mode_count(64) + 1)
    expected_variance = np.sum(2 * 625 * ((2 * np.pi * k) ** 2 + 25) ** -2.0)
    assert fields.var() == pytest.approx(expected_variance, rel=0.05)


# --- generated dataset --------------------------------------------------------------------------


def test_dataset_is_deterministic_by_seed_and_independent_of_chunking(tmp_path):
    a = generate_dataset(**SMALL, seed=1, use_cache=False)
    b = generate_dataset(**SMALL, seed=1, use_cache=False, chunk_size=2)
    c = generate_dataset(**SMALL, seed=2, use_cache=False)
    for key in ("x_train", "y_train", "x_test", "y_test"):
        assert a[key].shape == (SMALL["n_train"] if "train" in key else SMALL["n_test"], 64)
        assert a[key].dtype == np.float32
        np.testing.assert_array_equal(a[key], b[key])
        assert not np.allclose(a[key], c[key])
    # The test set does not depend on how many training samples were asked for.
    d = generate_dataset(**{**SMALL, "n_train": 2}, seed=1, use_cache=False, dt=a["meta"]["dt_used"])
    np.testing.assert_array_equal(d["x_test"], a["x_test"])


def test_dataset_with_two_workers_equals_one_worker():
    one = generate_dataset(**SMALL, use_cache=False, chunk_size=3, dt=0.01)
    two = generate_dataset(**SMALL, use_cache=False, chunk_size=3, dt=0.01, workers=2)
    np.testing.assert_array_equal(one["y_train"], two["y_train"])
    np.testing.assert_array_equal(one["y_test"], two["y_test"])


def test_dataset_targets_are_burgers_solutions():
    data = generate_dataset(**SMALL, use_cache=False)
    u0 = burgers._initial_conditions(SMALL["n_train"], 0, 0, SMALL["solve_grid"], alpha=2.0, tau=5.0, sigma=25.0)
    np.testing.assert_array_equal(data["x_train"], u0[:, ::4].astype(np.float32))
    exact = cole_hopf_solution(u0, 0.1, 1.0)
    np.testing.assert_allclose(data["y_train"], exact[:, ::4], atol=1e-6)


def test_same_samples_at_another_resolution_come_from_the_same_cache(tmp_path):
    calls = []
    base = generate_dataset(**SMALL, cache_dir=tmp_path, progress=lambda done, total: calls.append((done, total)))
    fine = generate_dataset(**{**SMALL, "grid_size": 256}, cache_dir=tmp_path)
    assert calls[-1] == (9, 9)
    assert not base["meta"]["cache_hit"] and fine["meta"]["cache_hit"]
    assert fine["x_test"].shape == (3, 256)
    np.testing.assert_array_equal(fine["x_test"][:, ::4], base["x_test"])
    np.testing.assert_array_equal(fine["y_test"][:, ::4], base["y_test"])
    with pytest.raises(DataError, match="divide"):
        generate_dataset(**{**SMALL, "grid_size": 96}, cache_dir=tmp_path)


def test_cache_hit_does_not_solve_again(tmp_path, forbid):
    first = generate_dataset(**SMALL, cache_dir=tmp_path)
    path = first["meta"]["cache_path"]
    assert path.startswith(str(tmp_path)) and path.endswith(".npz")
    forbid(burgers, "_solve_all", "a cache hit must not run the solver")
    second = generate_dataset(**SMALL, cache_dir=tmp_path)
    assert second["meta"]["cache_hit"]
    np.testing.assert_array_equal(first["y_train"], second["y_train"])
    # The parameters are recorded in the file as JSON.
    with np.load(path) as npz:
        assert json.loads(str(npz["meta"]))["params"]["viscosity"] == 0.1
    assert [p.name for p in tmp_path.iterdir()] == [path.rsplit("/", 1)[-1]]  # no temporary files left


def test_other_parameters_use_another_file(tmp_path):
    a = generate_dataset(**SMALL, cache_dir=tmp_path)
    b = generate_dataset(**SMALL, cache_dir=tmp_path, viscosity=0.05)
    assert a["meta"]["cache_path"] != b["meta"]["cache_path"]
    assert not b["meta"]["cache_hit"]
    assert not np.allclose(a["y_train"], b["y_train"])


def test_cache_with_other_recorded_parameters_is_regenerated(tmp_path, caplog):
    first = generate_dataset(**SMALL, cache_dir=tmp_path)
    path = first["meta"]["cache_path"]
    with np.load(path) as npz:
        arrays = {key: npz[key] for key in npz.files}
    meta = json.loads(str(arrays.pop("meta")))
    meta["params"]["seed"] = 99
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    with caplog.at_level(logging.WARNING, logger="science.burgers"):
        again = generate_dataset(**SMALL, cache_dir=tmp_path)
    assert not again["meta"]["cache_hit"]
    assert "other parameters" in caplog.text
    np.testing.assert_array_equal(again["y_train"], first["y_train"])
    assert generate_dataset(**SMALL, cache_dir=tmp_path)["meta"]["cache_hit"]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "nan"])
def test_corrupt_cache_file_is_regenerated(tmp_path, caplog, damage):
    first = generate_dataset(**SMALL, cache_dir=tmp_path)
    path = first["meta"]["cache_path"]
    if damage == "garbage":
        with open(path, "wb") as fh:
            fh.write(b"not a zip file")
    elif damage == "truncated":
        with open(path, "rb") as fh:
            head = fh.read(200)
        with open(path, "wb") as fh:
            fh.write(head)
    else:
        with np.load(path) as npz:
            arrays = {key: npz[key].copy() for key in npz.files}
        arrays["y_train"][0, 0] = np.nan
        np.savez(path, **arrays)
    with caplog.at_level(logging.WARNING, logger="science.burgers"):
        again = generate_dataset(**SMALL, cache_dir=tmp_path)
    assert not again["meta"]["cache_hit"] and "regenerating" in caplog.text
    np.testing.assert_array_equal(again["y_train"], first["y_train"])


# --- users' .npz files --------------------------------------------------------------------------


def save(tmp_path, name="data.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def test_user_npz_loads_and_splits(tmp_path):
    x = np.random.default_rng(0).standard_normal((10, 32, 1))
    path = save(tmp_path, x=x, y=2 * x)
    data = load_npz_dataset(path, val_fraction=0.2, seed=0)
    assert data["x_train"].shape == (8, 32) and data["x_test"].shape == (2, 32)
    assert data["x_train"].dtype == np.float32
    np.testing.assert_allclose(data["y_train"], 2 * data["x_train"])
    together = np.concatenate([data["x_train"], data["x_test"]])
    np.testing.assert_allclose(np.sort(together[:, 0]), np.sort(x[:, 0, 0].astype(np.float32)))
    again = load_npz_dataset(path, val_fraction=0.2, seed=0)
    np.testing.assert_array_equal(again["x_test"], data["x_test"])


def test_user_npz_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found.*nope.npz"):
        load_npz_dataset(tmp_path / "nope.npz")


def test_user_npz_missing_array_is_named(tmp_path):
    path = save(tmp_path, x=np.zeros((4, 16)), target=np.zeros((4, 16)))
    with pytest.raises(DataError, match=r"missing array\(s\) 'y'; found \['target', 'x'\]"):
        load_npz_dataset(path)


def test_user_npz_shape_mismatch_prints_both_shapes(tmp_path):
    path = save(tmp_path, x=np.zeros((4, 16)), y=np.zeros((4, 32)))
    with pytest.raises(DataError, match=r"x \(4, 16\) and y \(4, 32\)"):
        load_npz_dataset(path)


def test_user_npz_wrong_rank(tmp_path):
    path = save(tmp_path, x=np.zeros((4, 16, 2)), y=np.zeros((4, 16, 2)))
    with pytest.raises(DataError, match=r"'x' must have shape \[N, grid\] or \[N, grid, 1\], got \(4, 16, 2\)"):
        load_npz_dataset(path)


def test_user_npz_non_finite_values(tmp_path):
    y = np.zeros((4, 16))
    y[1, 3], y[2, 0] = np.nan, np.inf
    path = save(tmp_path, x=np.zeros((4, 16)), y=y)
    with pytest.raises(DataError, match="'y' has 2 NaN or inf"):
        load_npz_dataset(path)


def test_user_npz_too_few_samples(tmp_path):
    path = save(tmp_path, x=np.zeros((1, 16)), y=np.zeros((1, 16)))
    with pytest.raises(DataError, match="at least 2 samples.*got 1"):
        load_npz_dataset(path)


def test_user_npz_not_an_archive(tmp_path):
    path = tmp_path / "data.npz"
    path.write_bytes(b"hello")
    with pytest.raises(DataError, match="not a readable .npz"):
        load_npz_dataset(path)


def test_user_npz_bad_val_fraction(tmp_path):
    path = save(tmp_path, x=np.zeros((4, 16)), y=np.zeros((4, 16)))
    with pytest.raises(DataError, match="val_fraction"):
        load_npz_dataset(path, val_fraction=1.0)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)
