"""Activation-checkpointing presets, applied by block class to transformers models and plain modules.

Checkpointing drops a block's intermediate activations in the forward pass and recomputes them in the
backward pass: compute traded for memory (the usual fix when stage 3 still runs out of memory, since ZeRO shards
model states, not activations).

Presets:

- ``none``: nothing recomputed.
- ``full``: every block. Activation memory falls to one block input per block plus one block's inner
  activations; costs one extra forward (about +33 % compute for a transformer).
- ``every_k``: every k-th block (``k`` default 2): about half the saving for half the recompute.
- ``selective``: only the attention sub-module of each block, the part whose activations grow with
  the square of the sequence (Korthikanti et al. 2022, "selective activation recomputation"); cheap to
  recompute, most of the saving at long sequence lengths.
- ``save_memory_optimized``: the checkpointing to pair with ZeRO-3 instead of ``full``. Defined here as: every
  block except the last one. Under stage 3 the last block's parameters are still gathered when the
  backward pass begins, so recomputing it re-gathers and re-runs a block whose activations would be
  consumed immediately: pure waste. Dropping it saves one block's recompute and one all-gather per
  step while keeping (n-1)/n of ``full``'s saving.

Reentrant vs non-reentrant: with ZeRO-3 and frozen parameters (the LoRA case), PyTorch's
non-reentrant checkpoint compares the metadata of recomputed tensors with the saved ones and raises
``CheckpointError``, because ZeRO-3 has released the gathered parameters in between (upstream
transformers#34928, trl#2514). The reentrant form does not look at them, so it is the default here; it
needs one input that requires grad, which :func:`apply_activation_checkpointing` ensures for
transformers models with ``enable_input_require_grads`` when the embeddings are frozen.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from common.errors import ConfigError, nearest

AC_PRESETS: dict[str, str] = {
    "none": "No recomputation: fastest, most activation memory.",
    "full": "Recompute every block: activations ~1 block input per block, about +33 % compute.",
    "every_k": "Recompute every k-th block: about half of full's saving for half its cost.",
    "selective": "Recompute only attention in each block (Korthikanti et al.): most saving per FLOP at long sequences.",
    "save_memory_optimized": "Every block but the last (for ZeRO-3, instead of full): skips a wasted re-gather.",
}

ATTENTION_CHILD_NAMES = ("self_attn", "attention", "attn", "self_attention")


@dataclass
class CheckpointingReport:
    """What :func:`apply_activation_checkpointing` wrapped."""

    preset: str
    wrapped: list[str] = field(default_factory=list)
    num_blocks: int = 0

    def summary(self) -> str:
        """One line for the run log."""
        wrapped, blocks = len(self.wrapped), self.num_blocks
        return f"activation checkpointing {self.preset!r}: {wrapped} modules wrapped in {blocks} blocks"


def check_preset(name: str) -> str:
    """Return ``name`` if it is a preset, else raise ConfigError naming the nearest one."""
    if name not in AC_PRESETS:
        raise ConfigError(
            f"unknown activation_checkpointing {name!r}{nearest(name, AC_PRESETS)}; valid: {', '.join(AC_PRESETS)}"
        )
    return name


def find_blocks(
    model: torch.nn.Module, block_classes: Sequence[type | str] | None = None
) -> list[tuple[str, torch.nn.Module]]:
    """The model's repeated blocks, in forward order.

    Args:
        model: any module.
        block_classes: classes or class names of the blocks. Default: the Hugging Face model's
            ``_no_split_modules`` when it has them, else the element type of the longest ``ModuleList``.
    """
    if block_classes is None:
        names = getattr(model, "_no_split_modules", None) or []
        block_classes = list(names)
        if not block_classes:
            lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
            if not lists:
                raise ConfigError(f"{type(model).__name__} has no repeated blocks; pass block_classes")
            block_classes = [type(max(lists, key=len)[0])]
    wanted = {c if isinstance(c, str) else c.__name__ for c in block_classes}
    blocks = [(name, m) for name, m in model.named_modules() if type(m).__name__ in wanted]
    if not blocks:
        raise ConfigError(f"no module of class {sorted(wanted)} in {type(model).__name__}")
    return blocks


def _wrap_forward(module: torch.nn.Module, use_reentrant: bool) -> None:
    if getattr(module, "_zr_checkpointed", False):
        return
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        # Reentrant checkpoint tracks gradients through positional tensors only, and transformers
        # calls sub-modules with keywords (self_attn(hidden_states=...)): pass keyword tensors
        # positionally and rebuild the call inside.
        tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        other = {k: v for k, v in kwargs.items() if k not in tensor_keys}
        n_args = len(args)

        def run(*flat: Any) -> Any:
            return original(*flat[:n_args], **dict(zip(tensor_keys, flat[n_args:])), **other)

        return checkpoint(run, *args, *(kwargs[k] for k in tensor_keys), use_reentrant=use_reentrant)

    module.forward = forward  # type: ignore[method-assign]
    module._zr_checkpointed = True  # type: ignore[attr-defined]


def _attention_child(block: torch.nn.Module) -> torch.nn.Module | None:
    for name in ATTENTION_CHILD_NAMES:
        child = getattr(block, name, None)
        if isinstance(child, torch.nn.Module):
            return child
    for _, child in block.named_modules():
        if child is not block and "attention" in type(child).__name__.lower():
            return child
    return None


def select_modules(
    blocks: list[tuple[str, torch.nn.Module]], preset: str, every_k: int = 2
) -> list[tuple[str, torch.nn.Module]]:
    """Which modules a preset recomputes, given the model's blocks (pure: wraps nothing)."""
    check_preset(preset)
    if preset == "none":
        return []
    if preset == "full":
        return list(blocks)
    if preset == "every_k":
        if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
            raise ConfigError(f"every_k must be a positive integer, got {every_k!r}")
        return [b for i, b in enumerate(blocks) if i % every_k == every_k - 1 or every_k == 1]
    if preset == "save_memory_optimized":
        return list(blocks[:-1])
    selected = []
    for name, block in blocks:  # selective
        child = _attention_child(block)
        if child is None:
            raise ConfigError(
                f"selective checkpointing needs an attention sub-module in {type(block).__name__}; "
                "use every_k or full for this model"
            )
        selected.append((f"{name}.attention", child))
    return selected


def apply_activation_checkpointing(
    model: torch.nn.Module,
    preset: str,
    block_classes: Sequence[type | str] | None = None,
    every_k: int = 2,
    use_reentrant: bool = True,
) -> CheckpointingReport:
    """Apply an activation-checkpointing preset in place.

    Args:
        model: a transformers model or a plain module.
        preset: a key of :data:`AC_PRESETS`.
        block_classes: the block classes (see :func:`find_blocks`).
        every_k: the k of ``every_k``.
        use_reentrant: reentrant checkpoint (default; works with ZeRO-3 and frozen weights, see module doc).

    Returns:
        A report of the wrapped modules.
    """
    check_preset(preset)
    report = CheckpointingReport(preset=preset)
    if preset == "none":
        return report
    blocks = find_blocks(model, block_classes)
    report.num_blocks = len(blocks)
    for name, module in select_modules(blocks, preset, every_k):
        _wrap_forward(module, use_reentrant)
        report.wrapped.append(name)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # A KV cache filled during the forward pass is appended to again by the recomputation, and
        # the recomputed attention then differs (wrong gradients); transformers does the same.
        config.use_cache = False
    if use_reentrant and hasattr(model, "enable_input_require_grads"):
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embeddings is not None and not any(p.requires_grad for p in embeddings.parameters()):
            # Frozen embeddings (LoRA): make the first block input require grad, or reentrant
            # checkpointing would cut the graph and the adapters inside would get no gradient.
            model.enable_input_require_grads()
    return report


class _Saved:
    """A tensor saved for backward; autograd drops it when the node that saved it is done (or freed)."""

    def __init__(self, tensor: torch.Tensor, counter: SavedBytesCounter, key: tuple[int, int] | None) -> None:
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self) -> None:
        if self.key is not None:
            self.counter._release(self.key)


class SavedBytesCounter:
    """Bytes of activations autograd holds for the backward pass, live and at their peak.

    Installed with ``torch.autograd.graph.saved_tensors_hooks`` around the forward *and* backward pass,
    it sees every tensor saved for backward, including those saved again by a checkpoint's recomputation.
    Each storage is counted once however many views or nodes save it, and storages of the ``exclude``
    tensors (the parameters: weights saved by a matmul are not activations) not at all. A storage stops
    counting when the last node that saved it lets go, so ``peak_bytes`` is the most ever held at once.
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: collections.Counter[tuple[int, int]] = collections.Counter()
        self.live_bytes = 0
        self.peak_bytes = 0

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0 or key[0] in self._excluded:
            return _Saved(tensor, self, None)
        if self._refs[key] == 0:
            self.live_bytes += key[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] += 1
        return _Saved(tensor, self, key)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: tuple[int, int]) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= key[1]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager to run forward and backward under."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def saved_activation_bytes(
    model: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor]
) -> dict[str, int]:
    """Measure one training step's activations: ``{"end_of_forward": ..., "peak": ...}`` bytes saved for backward.

    Args:
        model: the model, in training mode, checkpointing applied as the run applies it.
        loss_of: runs the forward pass and returns the loss (e.g. ``lambda m: m(input_ids=x, labels=x).loss``).
    """
    counter = SavedBytesCounter(exclude=list(model.parameters()) + list(model.buffers()))
    with counter.hooks():
        loss = loss_of(model)
        end_of_forward = counter.live_bytes
        loss.backward()
    return {"end_of_forward": end_of_forward, "peak": counter.peak_bytes}


def enable_offloadable_checkpointing(model: torch.nn.Module) -> None:
    """Checkpoint every decoder layer with transformers' own gradient checkpointing (reentrant, as the presets),
    the form DeepSpeed's activation-checkpoint offload recognises (:func:`checkpoint_offload`)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"offload_checkpoints needs a transformers model with gradient checkpointing; {type(model).__name__} "
            "has none: use offload_checkpoints=false"
        )
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.2x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


def checkpoint_offload() -> Any:
    """DeepSpeed's activation-checkpoint offload (``CheckpointHiddenStatesOffload``, 0.19.8): entered around one
    micro-batch's forward *and* backward pass, it copies each checkpointed layer input (transformers' gradient
    checkpointing, :func:`enable_offloadable_checkpointing`) to pinned host memory on a side stream and back for the
    recomputation, so the device keeps about one layer input instead of one per layer. On a device without streams
    (a CPU) it moves nothing and only marks the inputs; its ``stats`` say which (reset at every entry)."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    return CheckpointHiddenStatesOffload()


def offload_text(stats: Any) -> str:
    """One line on what :func:`checkpoint_offload` did in the last micro-batch."""
    moved = f"{stats.offloaded_tensors} moved to host ({stats.offloaded_bytes:,} B)"
    if stats.marked_tensors and not stats.offloaded_tensors:
        moved += ": nothing is offloaded from a device that is host memory already (CPU)"
    return f"checkpoint offload: {stats.marked_tensors} layer inputs marked per micro-batch, {moved}"
