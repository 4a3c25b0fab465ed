"""FNO-1D (Li et al. 2021, "Fourier Neural Operator for Parametric PDEs"), plain torch.

Architecture as in the paper's ``fourier_1d.py``: features ``(u0(x), x)`` -> lifting ``Linear``
to ``width`` -> ``n_layers`` Fourier layers ``GELU(K(v) + W v)`` (no GELU after the last) ->
``Linear(width, proj_width)`` -> GELU -> ``Linear(proj_width, 1)``. With the defaults (16 modes,
width 64, 4 layers, projection 128) it has 549,569 parameters.

Precision policy (guide 2, 7.3: in science, precision matters):

* The spectral path - ``rfft``, the complex multiply by the spectral weights, ``irfft`` - always
  runs in float32/complex64, whatever the module or autocast dtype. The input is cast to float32,
  autocast is switched off locally, the weights are upcast, and the result is cast back to the
  input's dtype. Reasons: ``torch.fft`` refuses bf16 on CPU, and bf16 spectra lose the small
  high-mode coefficients that carry the solution's detail.
* Spectral weights are stored as *real* tensors ``[in, out, modes, 2]`` (real, imaginary) and
  viewed as complex only inside ``forward``: DeepSpeed cannot partition or cast complex
  parameters, and its bf16 mode casts every parameter to bf16 - which the upcast undoes for the
  multiply.
* Everything else (lifting, 1x1 convolutions, projection) follows the module's dtype or autocast,
  as usual - unless ``fp32_head=True``: then the projection head computes in float32 (weights
  upcast, autocast off) and returns float32, so the prediction itself is never rounded to bf16
  (bf16 rounding of ``u(x, T)`` alone is ~1e-3 relative error, the size of the paper's figure).

The grid feature is ``x_j = j / n`` (the periodic grid the data live on), not the paper code's
``linspace(0, 1, n)``, so that a model trained at one resolution sees the same coordinates at
another: zero-shot super-resolution.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def min_grid_size(modes: int) -> int:
    """Smallest grid whose real FFT has ``modes`` frequencies (``n // 2 + 1 >= modes``)."""
    return max(1, 2 * (modes - 1))


class SpectralConv1d(nn.Module):
    """Fourier integral operator ``K``: FFT, keep ``modes`` frequencies, multiply, inverse FFT.

    Runs in float32 regardless of module dtype or autocast (see the module docstring).

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        modes: Lowest Fourier modes kept; the grid needs ``n // 2 + 1 >= modes``.
    """

    def __init__(self, in_channels: int, out_channels: int, modes: int) -> None:
        super().__init__()
        if modes < 1:
            raise ValueError(f"modes must be >= 1, got {modes}")
        self.in_channels, self.out_channels, self.modes = (in_channels, out_channels, modes)
        # The paper's init: scale * U(0, 1) for the real and the imaginary parts.
        scale = 1.0 / (in_channels * out_channels)
        self.weight = nn.Parameter(scale * torch.rand(in_channels, out_channels, modes, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply ``K`` to ``x`` of shape ``[batch, in_channels, n]``; returns ``[batch, out_channels, n]``."""
        n = x.shape[-1]
        if n // 2 + 1 < self.modes:
            raise ValueError(
                f"a grid of {n} points has {n // 2 + 1} Fourier modes, fewer than modes={self.modes}: "
                f"use a grid of at least {min_grid_size(self.modes)} points or fewer modes"
            )
        with torch.autocast(device_type=x.device.type, enabled=False):
            x_ft = torch.fft.rfft(x.float(), dim=-1)[..., : self.modes]
            # .float() is a no-op for fp32 weights and the upcast for DeepSpeed's bf16 copies.
            weight = torch.view_as_complex(self.weight.float().contiguous())
            out_ft = torch.einsum("bim,iom->bom", x_ft, weight)
            # irfft zero-pads the missing high modes up to n // 2 + 1.
            y = torch.fft.irfft(out_ft, n=n, dim=-1)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        """Shown by print(model): the spectral path is float32 whatever the module dtype."""
        return f"{self.in_channels}, {self.out_channels}, modes={self.modes}, fft_dtype=float32"


class FNO1d(nn.Module):
    """Fourier neural operator for 1-D functions on a periodic grid, any resolution.

    Args:
        modes: Fourier modes kept per layer.
        width: Channels of the hidden function.
        n_layers: Fourier layers.
        proj_width: Hidden size of the projection head.
        in_channels: Input function channels (1 for Burgers' ``u0``); the grid is appended.
        out_channels: Output function channels.
        fp32_head: Compute the projection head in float32 whatever the module dtype (see the module
            docstring); the output is then float32.

    Shapes:
        ``[batch, n]`` -> ``[batch, n]``, or ``[batch, n, in_channels]`` -> ``[batch, n, out_channels]``.
    """

    def __init__(
        self,
        modes: int = 16,
        width: int = 64,
        n_layers: int = 4,
        proj_width: int = 128,
        in_channels: int = 1,
        out_channels: int = 1,
        fp32_head: bool = False,
    ) -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.modes, self.in_channels, self.out_channels = (modes, in_channels, out_channels)
        self.fp32_head = fp32_head
        self.lift = nn.Linear(in_channels + 1, width)
        self.spectral_layers = nn.ModuleList(SpectralConv1d(width, width, modes) for _ in range(n_layers))
        self.pointwise_layers = nn.ModuleList(nn.Conv1d(width, width, kernel_size=1) for _ in range(n_layers))
        self.project = nn.Sequential(nn.Linear(width, proj_width), nn.GELU(), nn.Linear(proj_width, out_channels))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """Map input functions sampled at ``x_j = j / n`` to output functions on the same grid."""
        squeeze = u.ndim == 2
        if squeeze:
            u = u.unsqueeze(-1)
        if u.ndim != 3 or u.shape[-1] != self.in_channels:
            raise ValueError(f"expected [batch, n] or [batch, n, {self.in_channels}], got {tuple(u.shape)}")
        batch, n, _ = u.shape
        if n // 2 + 1 < self.modes:
            raise ValueError(
                f"a grid of {n} points has {n // 2 + 1} Fourier modes, fewer than modes={self.modes}: "
                f"use a grid of at least {min_grid_size(self.modes)} points or a model with fewer modes"
            )
        # Inputs follow the parameters' dtype, so a bf16-cast module accepts float32 data.
        u = u.to(self.lift.weight.dtype)
        grid = (torch.arange(n, device=u.device, dtype=torch.float32) / n).to(u.dtype)
        v = self.lift(torch.cat([u, grid.expand(batch, n).unsqueeze(-1)], dim=-1))
        v = v.permute(0, 2, 1)  # [batch, width, n]: channels-first for Conv1d and the FFT
        last = len(self.spectral_layers) - 1
        for i, (spectral, pointwise) in enumerate(zip(self.spectral_layers, self.pointwise_layers, strict=True)):
            v = spectral(v) + pointwise(v)
            if i < last:
                v = F.gelu(v)
        v = v.permute(0, 2, 1)
        out = self._project_fp32(v) if self.fp32_head else self.project(v)
        return out.squeeze(-1) if squeeze and self.out_channels == 1 else out

    def _project_fp32(self, v: torch.Tensor) -> torch.Tensor:
        """The projection head in float32: the module's (e.g. bf16) weights are upcast, autocast is off."""
        first, last = self.project[0], self.project[2]
        with torch.autocast(device_type=v.device.type, enabled=False):
            h = F.gelu(F.linear(v.float(), first.weight.float(), first.bias.float()))
            return F.linear(h, last.weight.float(), last.bias.float())


def relative_l2(pred: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Per-sample relative L2 error ``||pred - target||_2 / ||target||_2``, the FNO paper's metric.

    Computed in float32 (bf16 norms would round the very quantity being measured).

    Args:
        pred: ``[batch, ...]`` predictions.
        target: Same shape as ``pred``.
        reduction: ``"mean"`` (the paper's number), ``"sum"`` or ``"none"`` (per sample).

    Returns:
        A scalar, or ``[batch]`` for ``reduction="none"``.
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred and target shapes differ: {tuple(pred.shape)} vs {tuple(target.shape)}")
    diff = (pred.float() - target.float()).reshape(pred.shape[0], -1)
    norm = target.float().reshape(target.shape[0], -1).norm(dim=1)
    # A zero target would give inf/NaN; the floor keeps the metric finite without changing any real value.
    errors = diff.norm(dim=1) / norm.clamp_min(torch.finfo(torch.float32).tiny)
    if reduction == "mean":
        return errors.mean()
    if reduction == "sum":
        return errors.sum()
    if reduction == "none":
        return errors
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements; each complex spectral weight counts as 2 (real, imaginary).

    Under ZeRO-3 a parameter's local tensor is a shard; DeepSpeed's ``ds_numel`` attribute holds
    its full size, so the count is the same before and after partitioning.
    """
    return sum(
        int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad or not trainable_only
    )
