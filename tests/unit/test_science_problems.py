"""The science recipe's two problems as a user configures them: Burgers (1-D) and Darcy flow (2-D).

Config checks, the paper's step schedule, the standardisation of inputs and outputs, the 2-D figure and a
user's 2-D ``.npz``: fast, in-process. The runs themselves are in tests/recipes/test_science_darcy.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _util import REPO, recipe_module
from safetensors.torch import load_file

from common.errors import ConfigError
from common.strategy import step_decay_with_warmup
from science.burgers import DataError, load_npz_dataset
from science.fno import FNO1d, FNO2d
from science.plots import plot_fields

RECIPE = REPO / "recipes" / "science"


def config(**overrides):
    return recipe_module(RECIPE, "science_config").ScienceConfig(**overrides)


DARCY = {"model": "fno2d", "data": "darcy", "grid_size": 85, "solve_grid": 421, "superres_factor": 1, "modes": 12}


def test_the_shipped_darcy_settings_are_a_valid_config():
    cfg = config(**DARCY)
    assert (cfg.model, cfg.data, cfg.padding) == ("fno2d", "darcy", 9)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({**DARCY, "model": "fno1d"}, "data=darcy needs model=fno2d"),
        ({"model": "fno2d"}, "data=burgers needs model=fno1d"),
        ({**DARCY, "solve_grid": 420}, "grid_size - 1 (84) must divide solve_grid - 1 (419)"),
        ({**DARCY, "grid_size": 13, "solve_grid": 25}, "too coarse for modes=12 with padding=9"),
        ({**DARCY, "superres_factor": 4}, "superres_factor is for burgers"),
        ({**DARCY, "padding": -1}, "padding must be >= 0"),
        ({"initial_field": "public_generatr"}, "did you mean 'public_generator'"),
        ({"lr_decay_gamma": 1.5}, "lr_decay_gamma must be in (0, 1]"),
        ({"model": "fno3d"}, "unknown model 'fno3d'"),
    ],
)
def test_impossible_science_configs_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError) as info:
        config(**overrides)
    assert message in str(info.value)


def test_public_generator_field_is_the_papers_gen_burgers1():
    fields = recipe_module(RECIPE, "science_config").INITIAL_FIELDS
    # gen_burgers1.m: GRF1(N/2, 0, gamma=2.5, tau=7, sigma=7^2); the text's field: alpha 2, tau 5, sigma 25.
    assert fields["public_generator"] == {"alpha": 2.5, "tau": 7.0, "sigma": 49.0}
    assert fields["paper_text"] == {"alpha": 2.0, "tau": 5.0, "sigma": 25.0}


def test_step_decay_is_the_papers_steplr_after_warmup():
    # StepLR(step_size=100, gamma=0.5): 1.0 for steps 0..99, 0.5 for 100..199, 0.25 from 200.
    assert [step_decay_with_warmup(s, 0, 100, 0.5) for s in (0, 99, 100, 199, 200, 450)] == [
        1.0,
        1.0,
        0.5,
        0.5,
        0.25,
        0.0625,
    ]
    assert [step_decay_with_warmup(s, 4, 100, 0.5) for s in (0, 1, 3, 4)] == [0.25, 0.5, 1.0, 1.0]


def test_standardised_fno_equals_the_plain_fno_on_hand_standardised_data():
    torch.manual_seed(0)
    plain = FNO2d(modes=3, width=6, n_layers=2, proj_width=8, padding=2)
    scaled = FNO2d(modes=3, width=6, n_layers=2, proj_width=8, padding=2, input_shift=7.5, input_scale=4.5)
    scaled.output_scale = 0.02
    scaled.load_state_dict(plain.state_dict())  # the constants are not weights: the state dicts match
    a = torch.where(torch.randn(2, 12, 12) >= 0, 12.0, 3.0)
    expected = plain((a - 7.5) / 4.5) * 0.02
    torch.testing.assert_close(scaled(a), expected, rtol=1e-6, atol=1e-9)
    assert FNO1d().input_shift == 0.0 and FNO1d().output_scale == 1.0  # Burgers' default: unchanged


def test_pairs_scaling_is_the_training_datas_mean_spread_and_rms():
    Pairs = recipe_module(RECIPE, "operator_learning").Pairs
    x = torch.tensor([[3.0, 12.0], [12.0, 12.0]])
    y = torch.tensor([[0.03, 0.04], [0.0, 0.0]])
    scaling = Pairs(x, y, x[:1], y[:1], {}).scaling()
    assert scaling["input_shift"] == pytest.approx(9.75)
    assert scaling["input_scale"] == pytest.approx(np.std([3.0, 12.0, 12.0, 12.0], ddof=1))
    assert scaling["output_scale"] == pytest.approx(np.sqrt((0.03**2 + 0.04**2) / 4))


def test_export_config_rebuilds_the_darcy_model_with_its_scaling(tmp_path):
    learning = recipe_module(RECIPE, "operator_learning")
    cfg = config(
        **{
            **DARCY,
            "modes": 3,
            "width": 6,
            "n_layers": 2,
            "proj_width": 8,
            "grid_size": 13,
            "solve_grid": 25,
            "padding": 2,
            "standardize": True,
        }
    )
    scaling = {"input_shift": 7.0, "input_scale": 4.0, "output_scale": 0.01}
    model = learning.build_model(cfg, scaling)
    final = learning.export_model(model.state_dict(), learning.architecture(cfg, scaling), cfg.model, tmp_path)
    arch = json.loads((final / "config.json").read_text())
    assert arch.pop("model") == "fno2d"
    rebuilt = FNO2d(**arch)
    rebuilt.load_state_dict(load_file(final / "model.safetensors"))
    # The reference: the same weights without scaling, on inputs standardised by hand, output scaled by hand.
    plain = FNO2d(modes=3, width=6, n_layers=2, proj_width=8, padding=2, fp32_head=True)
    plain.load_state_dict(model.state_dict())
    a = torch.rand(2, 13, 13) * 9 + 3
    torch.testing.assert_close(rebuilt(a), plain((a - 7.0) / 4.0) * 0.01)


def test_two_dimensional_figure_is_a_png(tmp_path):
    truth = torch.rand(3, 9, 9)
    path = plot_fields(torch.rand(3, 9, 9), truth, truth + 0.01, tmp_path / "fig" / "darcy.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_users_two_dimensional_npz_loads_for_fno2d_and_is_refused_for_fno1d(tmp_path):
    path = tmp_path / "fields.npz"
    np.savez(path, x=np.ones((5, 16, 16)), y=np.zeros((5, 16, 16, 1)))
    arrays = load_npz_dataset(path, n_dims=2)
    assert arrays["x_train"].shape == (4, 16, 16) and arrays["y_test"].shape == (1, 16, 16)
    assert arrays["meta"]["grid_size"] == 16
    with pytest.raises(DataError, match=r"must have shape \[N, grid\].*model=fno2d"):
        load_npz_dataset(path)
