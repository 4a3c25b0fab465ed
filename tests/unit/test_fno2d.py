"""FNO-2D: the generalised spectral layer against the paper's 2-D formula, shapes, precision, learning."""

from __future__ import annotations

import math

import pytest
import torch

from science.fno import FNO1d, FNO2d, SpectralConv, count_parameters, min_grid_size, relative_l2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_model(**kwargs) -> FNO2d:
    torch.manual_seed(0)
    return FNO2d(**{"modes": 4, "width": 8, "n_layers": 2, "proj_width": 16, "padding": 3, **kwargs})


def paper_spectral_conv2d(x: torch.Tensor, weights1: torch.Tensor, weights2: torch.Tensor) -> torch.Tensor:
    """``SpectralConv2d.forward`` of the paper's ``fourier_2d.py``: rfft2, two corner blocks, irfft2."""
    modes1, modes2 = weights1.shape[-2:]
    x_ft = torch.fft.rfft2(x)
    out_ft = torch.zeros(x.shape[0], weights1.shape[1], x.shape[-2], x.shape[-1] // 2 + 1, dtype=torch.cfloat)
    out_ft[:, :, :modes1, :modes2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :modes1, :modes2], weights1)
    out_ft[:, :, -modes1:, :modes2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -modes1:, :modes2], weights2)
    return torch.fft.irfft2(out_ft, s=(x.shape[-2], x.shape[-1]))


@pytest.mark.parametrize("grid", [(16, 16), (20, 13), (8, 9)])
def test_spectral_layer_equals_the_paper_formula(grid):
    torch.manual_seed(0)
    layer = SpectralConv(3, 2, modes=(4, 5))
    x = torch.randn(2, 3, *grid)
    weight = torch.view_as_complex(layer.weight.detach())  # [in, out, 2 * 4, 5]: positive rows, then negative
    expected = paper_spectral_conv2d(x, weight[:, :, :4], weight[:, :, 4:])
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_one_dimensional_case_is_the_paper_1d_layer():
    torch.manual_seed(0)
    layer = SpectralConv(3, 2, modes=6)
    assert layer.weight.shape == (3, 2, 6, 2)
    x = torch.randn(4, 3, 32)
    expected = torch.fft.irfft(
        torch.einsum("bim,iom->bom", torch.fft.rfft(x)[..., :6], torch.view_as_complex(layer.weight.detach())), n=32
    )
    torch.testing.assert_close(layer(x), expected, atol=1e-6, rtol=1e-6)


def test_spectral_layer_is_resolution_invariant_in_2d():
    """A band-limited periodic input gives the same output sampled on a coarse or a 2x finer grid."""
    torch.manual_seed(0)
    layer = SpectralConv(1, 2, modes=(3, 3))

    def band_limited(n: int) -> torch.Tensor:
        x = torch.arange(n, dtype=torch.float64) / n
        gx, gy = torch.meshgrid(x, x, indexing="ij")
        return (torch.sin(2 * math.pi * gx) * torch.cos(4 * math.pi * gy) + torch.cos(2 * math.pi * gy))[None, None]

    coarse, fine = layer(band_limited(16).float()), layer(band_limited(32).float())
    torch.testing.assert_close(fine[..., ::2, ::2], coarse, atol=1e-5, rtol=1e-5)


def test_paper_configuration_parameter_count():
    # 4 x 2 x 32 x 32 x 12 x 12 complex weights (counted twice here; once in the paper code's 1,188,353)
    # + lifting 3*32+32 + 4 x (32*32+32) + head 32*128+128 + 128+1.
    complex_weights = 4 * 2 * 32 * 32 * 12 * 12
    assert count_parameters(FNO2d()) == 1_188_353 + complex_weights == 2_368_001


def test_shapes_at_two_resolutions_and_channels_last():
    model = small_model()
    for n in (17, 29):
        assert model(torch.randn(2, n, n)).shape == (2, n, n)
    assert model(torch.randn(2, 17, 21, 1)).shape == (2, 17, 21, 1)
    with pytest.raises(ValueError, match=r"expected \[batch, n, n\]"):
        model(torch.randn(2, 17))


def test_grid_too_coarse_for_the_modes_is_a_clear_error():
    model = small_model(modes=8, padding=3)
    need = min_grid_size(8, n_dims=2, padding=3)
    assert need == 13
    assert model(torch.randn(1, need, need)).shape == (1, need, need)
    with pytest.raises(ValueError, match=r"12 x 12 points \(\+3 padding\).*at least 13 x 13"):
        model(torch.randn(1, 12, 12))


def test_coordinates_span_both_boundaries_in_2d_and_the_periodic_grid_in_1d():
    coords = small_model().coordinates((5, 3), torch.device("cpu"))
    assert coords.shape == (5, 3, 2)
    torch.testing.assert_close(coords[:, 0, 0], torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    torch.testing.assert_close(coords[0, :, 1], torch.tensor([0.0, 0.5, 1.0]))
    periodic = FNO1d(modes=2, width=4).coordinates((4,), torch.device("cpu"))
    torch.testing.assert_close(periodic[:, 0], torch.arange(4) / 4)


def test_padding_changes_the_operator_but_not_the_shape():
    x = torch.randn(2, 17, 17)
    padded, unpadded = small_model(padding=3), small_model(padding=0)
    unpadded.load_state_dict(padded.state_dict())
    assert not torch.allclose(padded(x), unpadded(x))


def test_fft_path_stays_float32_when_the_model_is_bf16(monkeypatch):
    seen = []
    for name in ("rfft", "irfft", "fft", "ifft"):
        original = getattr(torch.fft, name)

        def recording(x, *args, _name=name, _fn=original, **kwargs):
            seen.append((_name, x.dtype))
            return _fn(x, *args, **kwargs)

        monkeypatch.setattr(torch.fft, name, recording)
    model = small_model(fp32_head=True).to(torch.bfloat16)
    out = model(torch.randn(2, 17, 17))
    assert out.dtype == torch.float32  # the fp32 head
    assert {name for name, _ in seen} == {"rfft", "irfft", "fft", "ifft"}
    assert {dtype for name, dtype in seen if name == "rfft"} == {torch.float32}
    assert {dtype for name, dtype in seen if name != "rfft"} == {torch.complex64}


def test_bf16_model_tracks_the_fp32_model():
    model = small_model()
    x = torch.randn(3, 17, 17)
    reference = model(x)
    assert relative_l2(model.to(torch.bfloat16)(x), reference) < 0.05


def test_a_few_steps_fit_a_darcy_like_map():
    """Smoke test of learning: the loss on a fixed batch of a -> u pairs falls by half in 40 Adam steps."""
    torch.manual_seed(0)
    a = torch.where(torch.randn(8, 17, 17).cumsum(1).cumsum(2) >= 0, 12.0, 3.0)
    x = torch.linspace(0, 1, 17)
    bubble = (torch.sin(math.pi * x)[:, None] * torch.sin(math.pi * x)[None, :]).expand(8, 17, 17)
    u = bubble / a.mean(dim=(1, 2), keepdim=True)  # depends on a, zero on the boundary
    model = small_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = relative_l2(model(a), u)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 2
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
