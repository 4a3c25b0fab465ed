"""What every lint rule reads and returns: :class:`LintView` (the normalised input) and :class:`Finding`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.communication import Link

SEVERITIES = ("error", "warning", "info")

SOURCE_KINDS = ("recipe", "deepspeed", "accelerate", "run")
BACKENDS = ("lightning", "accelerate", "hf_trainer")


@dataclass(frozen=True)
class Finding:
    """One problem: which rule, how bad, what is wrong, and what to do."""

    rule_id: str
    severity: str
    message: str
    fix: str


@dataclass
class LintView:
    """The normalised input every rule reads.

    Attributes:
        ds_config: the DeepSpeed dict (resolved by the factory for a recipe; as written for a JSON).
        recipe_config: the recipe's config as a dict, or None for a bare DeepSpeed / accelerate file.
        source_kind: ``recipe``, ``deepspeed``, ``accelerate`` or ``run`` (a recipe linting itself).
        versions: installed versions, ``{"torch": "2.4.0", "deepspeed": "0.16.1", "nccl": "2.21.5"}``.
        backend: who consumes ``ds_config``: ``lightning``, ``accelerate``, ``hf_trainer`` or None (unknown).
        hidden_size: the model's hidden size, when known.
        num_params: the model's parameter count, when known.
        ranks_per_node: processes per node (offload host RAM).
        world_size: data-parallel ranks.
        host_ram_bytes: host RAM available for pinned offload buffers (None: not checked).
        device_memory_bytes: memory of one device (activation check; None: not checked).
        local_memory: ``(bytes, label)``: what one rank has on this machine (the first GPU's memory, or on a CPU
            the host RAM shared by its ranks; :func:`common.machine.local_device_memory`), for the
            stage-3 bucket
            check when ``device_memory_bytes`` is not given; None: not checked.
        model: :class:`common.memory_formulas.ModelFacts` for the activation estimate, or None.
        accelerate_config: the accelerate YAML, for accelerate sources.
        path: the file linted, for messages.
        accelerator: ``cuda`` or ``cpu``: what the run has (a recipe linting itself); None when the config may be
            for another machine (a file), so that GPU-only features are reported as info, not as errors.
        network: the link the data-parallel group crosses (``zero-recipes lint --network``), or None: not checked.
    """

    ds_config: dict[str, Any] | None
    recipe_config: dict[str, Any] | None = None
    source_kind: str = "deepspeed"
    versions: dict[str, str] = field(default_factory=dict)
    backend: str | None = None
    hidden_size: int | None = None
    num_params: int | None = None
    ranks_per_node: int = 1
    world_size: int = 1
    host_ram_bytes: float | None = None
    device_memory_bytes: float | None = None
    local_memory: tuple[float, str] | None = None
    model: Any = None
    accelerate_config: dict[str, Any] | None = None
    path: str | None = None
    accelerator: str | None = None
    network: Link | None = None

    # --- small readers the rules share ---

    @property
    def zero(self) -> dict[str, Any]:
        """``zero_optimization`` (empty when absent)."""
        zero = (self.ds_config or {}).get("zero_optimization")
        return zero if isinstance(zero, dict) else {}

    @property
    def stage(self) -> int:
        """The ZeRO stage (DeepSpeed's default 0 when absent or not a number)."""
        stage = self.zero.get("stage", 0)
        return stage if isinstance(stage, int) and not isinstance(stage, bool) else 0

    def section_enabled(self, name: str) -> bool:
        """Whether ``fp16`` / ``bf16`` is enabled in the DeepSpeed dict."""
        section = (self.ds_config or {}).get(name)
        if isinstance(section, dict):
            return section.get("enabled") is True
        return section is True

    def recipe(self, key: str, default: Any = None) -> Any:
        """A recipe config value, or ``default`` without a recipe config."""
        return (self.recipe_config or {}).get(key, default)

    def offload_device(self, section: str) -> str:
        """``cpu``, ``nvme`` or ``none`` for ``offload_optimizer`` / ``offload_param``."""
        offload = self.zero.get(section)
        if isinstance(offload, dict):
            return str(offload.get("device") or "none").lower()
        return "none"

    @property
    def precision(self) -> str:
        """``fp16``, ``bf16`` or ``fp32`` as the DeepSpeed dict says (the recipe's when there is no dict)."""
        if self.ds_config is None:
            return str(self.recipe("precision", "fp32"))
        if self.section_enabled("fp16"):
            return "fp16"
        if self.section_enabled("bf16"):
            return "bf16"
        return "fp32"

    @property
    def where(self) -> str:
        """``path: `` prefix for messages."""
        return f"{self.path}: " if self.path else ""


Rule = Callable[[LintView], list[Finding]]


def as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
