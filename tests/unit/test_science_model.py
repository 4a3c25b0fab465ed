"""FNO-1D: shapes at any resolution, the float32 spectral path under bf16, the metric, the plot."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from science.fno import FNO1d, SpectralConv1d, count_parameters, relative_l2
from science.plots import plot_predictions

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_model(**kwargs) -> FNO1d:
    torch.manual_seed(0)
    return FNO1d(**{"modes": 8, "width": 16, "n_layers": 3, "proj_width": 32, **kwargs})


@pytest.fixture
def fft_dtypes(monkeypatch):
    """Record the dtype of every tensor handed to torch.fft.rfft / irfft, and of their results."""
    seen: list[tuple[str, torch.dtype, torch.dtype]] = []
    rfft, irfft = torch.fft.rfft, torch.fft.irfft

    def recording(name, fn):
        def wrapper(x, *args, **kwargs):
            y = fn(x, *args, **kwargs)
            seen.append((name, x.dtype, y.dtype))
            return y

        return wrapper

    monkeypatch.setattr(torch.fft, "rfft", recording("rfft", rfft))
    monkeypatch.setattr(torch.fft, "irfft", recording("irfft", irfft))
    return seen


def test_paper_configuration_parameter_count():
    # Lifting 2*64+64, 4 x (64*64*16*2 spectral + 64*64+64 pointwise), head 64*128+128 + 128+1.
    assert count_parameters(FNO1d()) == 549_569


@pytest.mark.parametrize("n", [64, 256])
def test_output_shapes_at_two_resolutions(n):
    model = small_model()
    assert model(torch.randn(3, n)).shape == (3, n)
    assert model(torch.randn(3, n, 1)).shape == (3, n, 1)


def test_grid_too_coarse_for_the_modes_is_a_clear_error():
    model = small_model(modes=16)
    assert model(torch.randn(2, 30)).shape == (2, 30)  # 30 // 2 + 1 == 16: just enough
    with pytest.raises(ValueError, match="28 points has 15 Fourier modes, fewer than modes=16.*at least 30"):
        model(torch.randn(2, 28))


def test_spectral_layer_is_resolution_invariant():
    """A band-limited input gives the same output sampled on a coarse or a 4x finer grid."""
    torch.manual_seed(0)
    layer = SpectralConv1d(2, 3, modes=6)

    def band_limited(n: int) -> torch.Tensor:
        x = torch.arange(n, dtype=torch.float64) / n
        return torch.stack([torch.sin(2 * math.pi * x) + 0.5 * torch.cos(6 * math.pi * x), torch.sin(10 * math.pi * x)])

    coarse = layer(band_limited(32).float().unsqueeze(0))
    fine = layer(band_limited(128).float().unsqueeze(0))
    torch.testing.assert_close(fine[..., ::4], coarse, atol=1e-5, rtol=1e-5)


def test_fft_path_stays_float32_when_the_model_is_bf16(fft_dtypes):
    model = small_model().to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    out = model(torch.randn(2, 64))  # float32 data into a bf16 model, as DeepSpeed bf16 would feed it
    assert out.dtype == torch.bfloat16
    assert len(fft_dtypes) == 2 * len(model.spectral_layers)
    for name, x_dtype, y_dtype in fft_dtypes:
        if name == "rfft":
            assert (x_dtype, y_dtype) == (torch.float32, torch.complex64)
        else:
            assert (x_dtype, y_dtype) == (torch.complex64, torch.float32)


def test_fft_path_stays_float32_under_bf16_autocast(fft_dtypes):
    model = small_model()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 64))
    assert out.dtype == torch.bfloat16  # autocast still rules the Linear / Conv1d layers
    assert {x for name, x, _ in fft_dtypes if name == "rfft"} == {torch.float32}
    assert {y for name, _, y in fft_dtypes if name == "irfft"} == {torch.float32}


def test_bf16_model_tracks_the_fp32_model():
    model = small_model()
    x = torch.randn(4, 64)
    reference = model(x)
    low = model.to(torch.bfloat16)(x)
    assert relative_l2(low, reference) < 0.05


def test_gradients_flow_in_bf16():
    model = small_model().to(torch.bfloat16)
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    loss = relative_l2(model(x), y)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.dtype == torch.bfloat16, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_relative_l2_values():
    target = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    pred = torch.tensor([[3.0, 4.0 + 0.5], [1.0, 2.0]])  # errors 0.5 / 5 and 2 / 1
    torch.testing.assert_close(relative_l2(pred, target, reduction="none"), torch.tensor([0.1, 2.0]))
    torch.testing.assert_close(relative_l2(pred, target), torch.tensor(1.05))
    torch.testing.assert_close(relative_l2(pred, target, reduction="sum"), torch.tensor(2.1))
    assert relative_l2(target, target) == 0
    # Per-sample over all trailing dims, in float32 even for bf16 inputs.
    three_d = relative_l2(pred.unsqueeze(-1).bfloat16(), target.unsqueeze(-1).bfloat16(), reduction="none")
    assert three_d.dtype == torch.float32
    torch.testing.assert_close(three_d, torch.tensor([0.1, 2.0]), atol=2e-3, rtol=2e-3)


def test_relative_l2_errors_and_zero_target():
    with pytest.raises(ValueError, match="shapes differ"):
        relative_l2(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="reduction"):
        relative_l2(torch.zeros(2, 3), torch.ones(2, 3), reduction="max")
    assert torch.isfinite(relative_l2(torch.ones(1, 3), torch.zeros(1, 3)))


def test_count_parameters_trainable_and_zero3_sizes():
    model = small_model()
    total = count_parameters(model)
    model.lift.weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == total - model.lift.weight.numel()
    # Under ZeRO-3 the local tensor is a shard and ds_numel holds the full size.
    model.lift.bias.ds_numel = model.lift.bias.numel()
    model.lift.bias.data = torch.empty(0)
    assert count_parameters(model) == total


def test_plot_predictions_writes_a_png(tmp_path):
    x = np.arange(64) / 64
    u0 = np.sin(2 * np.pi * x)[None].repeat(4, axis=0)
    truth = 0.1 * u0
    pred = torch.from_numpy(truth * 1.01).float().unsqueeze(-1)
    path = plot_predictions(x, u0, truth, pred, tmp_path / "figs" / "pred.png", n=3, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
