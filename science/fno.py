"""Fourier neural operators (Li et al. 2021, "Fourier Neural Operator for Parametric PDEs"), plain torch.

One spectral layer, :class:`SpectralConv`, works on any number of spatial dimensions; :class:`FNO1d`
(Burgers) and :class:`FNO2d` (Darcy flow) are the paper's ``fourier_1d.py`` and ``fourier_2d.py`` built
from it: features ``(input function, coordinates)`` -> lifting ``Linear`` to ``width`` -> ``n_layers``
Fourier layers ``GELU(K(v) + W v)`` (no GELU after the last) -> ``Linear(width, proj_width)`` -> GELU
-> ``Linear(proj_width, out)``. With the defaults FNO1d (16 modes, width 64, 4 layers, projection 128)
has 549,569 parameters and FNO2d (12 x 12 modes, width 32, 4 layers, projection 128) 2,368,001 (the
paper's code printed 1,188,353 for it, counting each complex weight once).

Precision policy (in science, precision matters):

* The spectral path - the FFTs, the complex multiply by the spectral weights, the inverse FFTs -
  always runs in float32/complex64, whatever the module or autocast dtype. The input is cast to
  float32, autocast is switched off locally, the weights are upcast, and the result is cast back to
  the input's dtype. Reasons: ``torch.fft`` refuses bf16 on CPU, and bf16 spectra lose the small
  high-mode coefficients that carry the solution's detail.
* Spectral weights are complex numbers stored as *real* tensors ``[in, out, *modes, 2]`` (real,
  imaginary) and viewed as complex only inside ``forward``: DeepSpeed cannot partition or cast
  complex parameters, and its bf16 mode casts every parameter to bf16 - which the upcast undoes for
  the multiply. Under ZeRO-3 the pair dimension is gathered whole with the rest of the tensor.
* Everything else (lifting, 1x1 convolutions, projection) follows the module's dtype or autocast,
  as usual - unless ``fp32_head=True``: then the projection head computes in float32 (weights
  upcast, autocast off) and returns float32, so the prediction itself is never rounded to bf16
  (bf16 rounding of ``u(x, T)`` alone is ~1e-3 relative error, the size of the paper's figure).

Coordinates: FNO1d's functions live on a periodic grid, ``x_j = j / n`` (not the paper code's
``linspace(0, 1, n)``), so that a model trained at one resolution sees the same coordinates at
another: zero-shot super-resolution. FNO2d's Darcy domain is not periodic: its nodes include both
boundaries, ``x_i = i / (n - 1)`` (as the paper's ``get_grid``), and ``padding`` zero points are
appended to each spatial dimension before the Fourier layers and cut after (the paper's remedy for
the FFT's periodicity).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


def min_grid_size(modes: int, n_dims: int = 1, padding: int = 0) -> int:
    """Smallest grid side whose FFT holds ``modes`` frequencies per dimension.

    The last (real-FFT) dimension needs ``n // 2 + 1 >= modes``; each other dimension keeps ``modes``
    positive and ``modes`` negative frequencies, so it needs ``n >= 2 modes``. ``padding`` points are
    added to each side before the FFT.
    """
    need = 2 * modes if n_dims > 1 else 2 * (modes - 1)
    return max(1 if n_dims == 1 else 2, need - padding)


class SpectralConv(nn.Module):
    """Fourier integral operator ``K`` over the last ``len(modes)`` dimensions: FFT, keep the lowest
    frequencies, multiply by complex weights, inverse FFT.

    The last dimension is transformed by a real FFT and keeps frequencies ``0 .. m - 1``; every other
    dimension keeps the ``m`` lowest positive and ``m`` lowest negative ones (the paper's ``weights1``
    and ``weights2`` of ``fourier_2d.py``, one tensor here). In one dimension this is the paper's
    ``SpectralConv1d``. Runs in float32 regardless of module dtype or autocast (see the module
    docstring).

    Args:
        in_channels: Input channels.
        out_channels: Output channels.
        modes: Frequencies kept per spatial dimension, an int for one dimension.
    """

    def __init__(self, in_channels: int, out_channels: int, modes: int | Sequence[int]) -> None:
        super().__init__()
        modes = (modes,) if isinstance(modes, int) else tuple(int(m) for m in modes)
        if not modes or min(modes) < 1:
            raise ValueError(f"modes must be >= 1 in every dimension, got {modes}")
        self.in_channels, self.out_channels, self.modes = (in_channels, out_channels, modes)
        kept = (*(2 * m for m in modes[:-1]), modes[-1])
        # The paper's init: scale * U(0, 1) for the real and the imaginary parts.
        scale = 1.0 / (in_channels * out_channels)
        self.weight = nn.Parameter(scale * torch.rand(in_channels, out_channels, *kept, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply ``K`` to ``x`` of shape ``[batch, in_channels, *grid]``; returns ``[batch, out_channels, *grid]``."""
        n_dims = len(self.modes)
        grid = tuple(x.shape[-n_dims:])
        too_few = grid[-1] // 2 + 1 < self.modes[-1] or any(n < 2 * m for n, m in zip(grid, self.modes[:-1]))
        if too_few:
            need = " x ".join(str(min_grid_size(m, n_dims)) for m in self.modes)
            raise ValueError(
                f"a grid of {' x '.join(map(str, grid))} points has too few Fourier modes for modes="
                f"{self.modes}: needs at least {need} points"
            )
        leading = range(-n_dims, -1)  # the dimensions before the last, by negative index
        with torch.autocast(device_type=x.device.type, enabled=False):
            x_ft = torch.fft.rfft(x.float(), dim=-1)[..., : self.modes[-1]]
            for dim, m in zip(leading, self.modes[:-1]):
                x_ft = torch.fft.fft(x_ft, dim=dim)
                x_ft = torch.cat([x_ft.narrow(dim, 0, m), x_ft.narrow(dim, x_ft.shape[dim] - m, m)], dim=dim)
            # .float() is a no-op for fp32 weights and the upcast for DeepSpeed's bf16 copies.
            weight = torch.view_as_complex(self.weight.float().contiguous())
            out_ft = torch.einsum("bi...,io...->bo...", x_ft, weight)
            for dim, m, n in zip(leading, self.modes[:-1], grid[:-1]):
                gap = list(out_ft.shape)
                gap[dim] = n - 2 * m
                out_ft = torch.cat([out_ft.narrow(dim, 0, m), out_ft.new_zeros(gap), out_ft.narrow(dim, m, m)], dim)
                out_ft = torch.fft.ifft(out_ft, dim=dim)
            # irfft zero-pads the missing high modes up to n // 2 + 1.
            y = torch.fft.irfft(out_ft, n=grid[-1], dim=-1)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        """Shown by print(model): the spectral path is float32 whatever the module dtype."""
        modes = self.modes[0] if len(self.modes) == 1 else self.modes
        return f"{self.in_channels}, {self.out_channels}, modes={modes}, fft_dtype=float32"


# The one-dimensional layer's name in the paper's code and in this package's first version.
SpectralConv1d = SpectralConv


class HeadLinear(nn.Linear):
    """``nn.Linear`` that, with ``compute_fp32``, computes in float32 whatever its weights' dtype (autocast off).

    The upcast happens inside the layer's own ``forward``: ZeRO-3 gathers a layer's partitioned weights when
    the layer is called, so reading ``weight`` from outside the layer would see an empty partition.
    """

    compute_fp32 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.compute_fp32:
            return super().forward(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)


class FourierNeuralOperator(nn.Module):
    """The FNO body shared by :class:`FNO1d` and :class:`FNO2d`: channels-last functions on a grid in, out.

    Args:
        n_dims: Spatial dimensions.
        modes: Fourier modes kept per layer, in every dimension.
        width: Channels of the hidden function.
        n_layers: Fourier layers.
        proj_width: Hidden size of the projection head.
        in_channels: Input function channels; the coordinates are appended.
        out_channels: Output function channels.
        fp32_head: Compute the projection head in float32 whatever the module dtype (see the module
            docstring); the output is then float32.
        periodic: Coordinates ``j / n`` (periodic grid) rather than ``i / (n - 1)`` (both boundaries).
        padding: Zero points appended to each spatial dimension around the Fourier layers.
        input_shift, input_scale: The input is standardised as ``(u - shift) / scale`` (in float32) first.
        output_scale: The output is multiplied by it last. Darcy's ``a`` is 3 or 12 and its ``u`` about
            0.01: standardising both, as the paper's ``UnitGaussianNormalizer``, keeps the layers near unit
            scale. Plain floats, not buffers: DeepSpeed would cast buffers to bf16, and an export's
            ``config.json`` carries them so the model rebuilds with its own scaling.
    """

    def __init__(
        self,
        n_dims: int,
        modes: int,
        width: int,
        n_layers: int,
        proj_width: int,
        in_channels: int,
        out_channels: int,
        fp32_head: bool,
        periodic: bool,
        padding: int,
        input_shift: float = 0.0,
        input_scale: float = 1.0,
        output_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if input_scale <= 0 or output_scale <= 0:
            raise ValueError(f"input_scale and output_scale must be > 0, got {input_scale} and {output_scale}")
        self.input_shift, self.input_scale, self.output_scale = (
            float(input_shift),
            float(input_scale),
            float(output_scale),
        )
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        self.n_dims, self.modes, self.in_channels, self.out_channels = (n_dims, modes, in_channels, out_channels)
        self.periodic, self.padding = periodic, padding
        pointwise = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[n_dims - 1]
        self.lift = nn.Linear(in_channels + n_dims, width)
        self.spectral_layers = nn.ModuleList(SpectralConv(width, width, (modes,) * n_dims) for _ in range(n_layers))
        self.pointwise_layers = nn.ModuleList(pointwise(width, width, kernel_size=1) for _ in range(n_layers))
        self.project = nn.Sequential(HeadLinear(width, proj_width), nn.GELU(), HeadLinear(proj_width, out_channels))
        self.fp32_head = fp32_head

    @property
    def fp32_head(self) -> bool:
        """Whether the projection head computes in float32 (see the module docstring)."""
        return self.project[0].compute_fp32

    @fp32_head.setter
    def fp32_head(self, value: bool) -> None:
        for layer in (self.project[0], self.project[2]):
            layer.compute_fp32 = bool(value)

    def coordinates(self, grid: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """``[*grid, n_dims]`` float32 coordinates of the grid's points in the unit cube."""
        spacing = [n if self.periodic else max(n - 1, 1) for n in grid]
        axes = [torch.arange(n, device=device, dtype=torch.float32) / d for n, d in zip(grid, spacing)]
        return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)

    def operate(self, u: torch.Tensor) -> torch.Tensor:
        """``[batch, *grid, in_channels]`` -> ``[batch, *grid, out_channels]``; the grid is checked by the caller."""
        batch, grid = u.shape[0], tuple(u.shape[1:-1])
        # Standardised in float32, then the parameters' dtype, so a bf16-cast module accepts float32 data.
        u = ((u.float() - self.input_shift) / self.input_scale).to(self.lift.weight.dtype)
        coords = self.coordinates(grid, u.device).to(u.dtype).expand(batch, *grid, self.n_dims)
        v = self.lift(torch.cat([u, coords], dim=-1)).movedim(-1, 1)  # channels first for the convs and FFTs
        if self.padding:
            v = F.pad(v, [0, self.padding] * self.n_dims)
        last = len(self.spectral_layers) - 1
        for i, (spectral, pointwise) in enumerate(zip(self.spectral_layers, self.pointwise_layers, strict=True)):
            v = spectral(v) + pointwise(v)
            if i < last:
                v = F.gelu(v)
        for dim, n in enumerate(grid, start=2):
            v = v.narrow(dim, 0, n)
        v = v.movedim(1, -1)
        out = self.project(v)
        return out * self.output_scale if self.output_scale != 1.0 else out

    def _channels_last(self, u: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Accept ``[batch, *grid]`` (one channel) or ``[batch, *grid, in_channels]``; say which it was."""
        squeeze = u.ndim == self.n_dims + 1
        if squeeze:
            u = u.unsqueeze(-1)
        if u.ndim != self.n_dims + 2 or u.shape[-1] != self.in_channels:
            grid = ", ".join("n" for _ in range(self.n_dims))
            raise ValueError(f"expected [batch, {grid}] or [batch, {grid}, {self.in_channels}], got {tuple(u.shape)}")
        return u, squeeze

    def _unchannel(self, out: torch.Tensor, squeeze: bool) -> torch.Tensor:
        return out.squeeze(-1) if squeeze and self.out_channels == 1 else out


class FNO1d(FourierNeuralOperator):
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
        scaling: ``input_shift``, ``input_scale``, ``output_scale`` (:class:`FourierNeuralOperator`).

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
        **scaling: float,
    ) -> None:
        super().__init__(
            1, modes, width, n_layers, proj_width, in_channels, out_channels, fp32_head, True, 0, **scaling
        )

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """Map input functions sampled at ``x_j = j / n`` to output functions on the same grid."""
        u, squeeze = self._channels_last(u)
        n = u.shape[1]
        if n // 2 + 1 < self.modes:
            raise ValueError(
                f"a grid of {n} points has {n // 2 + 1} Fourier modes, fewer than modes={self.modes}: "
                f"use a grid of at least {min_grid_size(self.modes)} points or a model with fewer modes"
            )
        return self._unchannel(self.operate(u), squeeze)


class FNO2d(FourierNeuralOperator):
    """Fourier neural operator for 2-D functions on the nodes of the unit square (both boundaries), any resolution.

    Args:
        modes: Fourier modes kept per layer in each dimension (the paper's ``modes1 = modes2``).
        width: Channels of the hidden function.
        n_layers: Fourier layers.
        proj_width: Hidden size of the projection head.
        in_channels: Input function channels (1 for Darcy's ``a``); the coordinates are appended.
        out_channels: Output function channels.
        fp32_head: Compute the projection head in float32 whatever the module dtype.
        padding: Zero points appended to each dimension around the Fourier layers (the paper: 9).
        scaling: ``input_shift``, ``input_scale``, ``output_scale`` (:class:`FourierNeuralOperator`).

    Shapes:
        ``[batch, nx, ny]`` -> ``[batch, nx, ny]``, or ``[batch, nx, ny, in_channels]`` ->
        ``[batch, nx, ny, out_channels]``.
    """

    def __init__(
        self,
        modes: int = 12,
        width: int = 32,
        n_layers: int = 4,
        proj_width: int = 128,
        in_channels: int = 1,
        out_channels: int = 1,
        fp32_head: bool = False,
        padding: int = 9,
        **scaling: float,
    ) -> None:
        super().__init__(
            2, modes, width, n_layers, proj_width, in_channels, out_channels, fp32_head, False, padding, **scaling
        )

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        """Map input functions at the nodes ``(i, j) / (n - 1)`` to output functions at the same nodes."""
        a, squeeze = self._channels_last(a)
        grid = tuple(a.shape[1:3])
        need = min_grid_size(self.modes, 2, self.padding)
        if min(grid) < need:
            raise ValueError(
                f"a grid of {grid[0]} x {grid[1]} points (+{self.padding} padding) has too few Fourier modes for "
                f"modes={self.modes}: use a grid of at least {need} x {need} points or a model with fewer modes"
            )
        return self._unchannel(self.operate(a), squeeze)


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
