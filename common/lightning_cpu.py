"""Lightning's DeepSpeed strategy, made to run real ZeRO on a CPU as well as on GPUs.

Lightning's ``DeepSpeedStrategy`` refuses a CPU in three places (tested with lightning 2.6, see ``TESTED_LIGHTNING``):

1. ``setup_environment`` raises unless the accelerator is CUDA;
2. ``setup_distributed`` validates device indices against local ranks (CPU devices have no index);
3. ``_setup_model_and_optimizer`` passes ``root_device.index`` (None on CPU) to DeepSpeed as ``device_rank``.

DeepSpeed itself runs on a CPU: it picks its CPU accelerator, uses gloo for collectives and compiles
its CPU Adam on first use. This subclass skips the two checks and passes the local rank, on a CPU
only; on a GPU every method is Lightning's own. ``tests/distributed`` trains stages 0-3 through it, so a
Lightning upgrade that moves these places fails a test rather than silently falling back to DDP.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from typing import Any

import lightning
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from common.resume import param_groups_kept

# The Lightning versions this subclass is tested against (CI runs 2.6.x). The private methods it overrides
# (``_setup_model_and_optimizer``, ``_init_deepspeed_distributed``) may move in any minor release.
TESTED_LIGHTNING = ">=2.6,<2.7"


def untested_lightning_message(version: str) -> str | None:
    """The warning for a Lightning ``version`` outside :data:`TESTED_LIGHTNING`, or None when it is tested."""
    if Version(version) in SpecifierSet(TESTED_LIGHTNING):
        return None
    return (
        f"lightning {version} is outside the versions common.lightning_cpu is tested with ({TESTED_LIGHTNING}): "
        "ZeRO on a CPU overrides private DeepSpeedStrategy methods that may have changed; "
        "run tests/distributed/test_zero_cpu.py to check it"
    )


def warn_if_untested_lightning() -> None:
    """Warn (once per process) when the installed Lightning is not one this module is tested with."""
    _warn_once(lightning.__version__)


@functools.cache
def _warn_once(version: str) -> None:
    message = untested_lightning_message(version)
    if message:
        warnings.warn(message, UserWarning, stacklevel=4)


class ZeroDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` that also accepts ``Trainer(accelerator="cpu", devices=N)``."""

    strategy_name = "zero_deepspeed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warn_if_untested_lightning()
        super().__init__(*args, **kwargs)

    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def setup_environment(self) -> None:
        if not self._on_cpu:
            return super().setup_environment()
        # Skip only the CUDA check: DDPStrategy's setup (which calls setup_distributed) still runs.
        DDPStrategy.setup_environment(self)
        return None

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()
        return None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # ZeRO-3 universal loads give every param group the settings of group 0 (common.resume.param_groups_kept).
        optimizer = getattr(self.deepspeed_engine, "optimizer", None)
        if optimizer is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        with param_groups_kept(optimizer):
            return super().load_checkpoint(checkpoint_path, weights_only)

    def _device_rank(self) -> int | None:
        index = self.root_device.index
        return self.local_rank if index is None else index

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        if not self._on_cpu:
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer
