"""Lightning's DeepSpeed strategy, made to run real ZeRO on a CPU as well as on GPUs.

Lightning's ``DeepSpeedStrategy`` refuses a CPU in three places (tested with lightning 2.6, see ``TESTED_LIGHTNING``):

1. ``setup_environment`` raises unless the accelerator is CUDA;
2. ``setup_distributed`` validates device indices against local ranks (CPU devices have no index);
3. ``_setup_model_and_optimizer`` passes ``root_device.index`` (None on CPU) to DeepSpeed as ``device_rank``.

DeepSpeed itself runs on a CPU: it picks its CPU accelerator, uses gloo for collectives and compiles
its CPU Adam on first use. This subclass skips the two checks and passes the local rank, on a CPU
only; on a GPU every method is Lightning's own. ``tests/distributed`` trains stages 0-3 through it, so a
Lightning upgrade that moves these places fails a test rather than silently falling back to DDP.

On every device it also divides an accumulated loss once, not twice (:meth:`ZeroDeepSpeedStrategy.backward`):
Lightning's automatic optimization divides the loss by ``accumulate_grad_batches`` and its DeepSpeed plugin then
calls ``engine.backward(loss)``, which divides by ``gradient_accumulation_steps`` again (Lightning #6170).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import warnings
from collections.abc import Generator, Iterator
from typing import Any

import lightning
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import PreTrainedModel, modeling_utils
from transformers.integrations import HfDeepSpeedConfig

try:  # the shield transformers puts around RoPE buffers when it enters zero.Init itself
    from transformers.integrations.deepspeed import prevent_arange_dtype_change
except ImportError:  # older transformers: RoPE buffers follow the training dtype, as they did there
    prevent_arange_dtype_change = contextlib.nullcontext

from common.errors import ConfigError
from common.hang import report_failure
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


UNSHARDED_INIT_HINT = (
    "{name} was built by calling its constructor inside configure_model under ZeRO-3: its weights were "
    "partitioned as each layer was created, so transformers' weight initialisation wrote into empty shards and "
    "the model would train from the wrong initial weights. Build it with "
    "AutoModelFor...from_config(config) or from_pretrained(path) inside configure_model instead"
)


@contextlib.contextmanager
def _refuse_unsharded_hf_init() -> Iterator[None]:
    """Refuse a transformers model constructed directly (not via from_config/from_pretrained) under ZeRO-3.

    transformers initialises weights through gathered parameters only on its own ZeRO-3 path, which it
    marks with ``modeling_utils._is_ds_init_called`` while the model is constructed. ``post_init`` runs at
    the end of every transformers model's ``__init__``: recording that mark there tells the two paths apart.
    """
    built_outside: list[str] = []
    original_post_init = PreTrainedModel.post_init

    def post_init(model: Any, *args: Any, **kwargs: Any) -> Any:
        if not modeling_utils._is_ds_init_called:
            built_outside.append(type(model).__name__)
        return original_post_init(model, *args, **kwargs)

    PreTrainedModel.post_init = post_init
    try:
        yield
    finally:
        PreTrainedModel.post_init = original_post_init
    if built_outside:
        raise ConfigError(UNSHARDED_INIT_HINT.format(name=built_outside[-1]))


class ZeroDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` that also accepts ``Trainer(accelerator="cpu", devices=N)``.

    Under ZeRO-3 it also owns model construction, as Accelerate's plugin does: an ``HfDeepSpeedConfig`` is
    kept alive from ``configure_model`` to the end of the run, so that ``from_config`` / ``from_pretrained``
    create and initialise every weight already sharded; ``arange``-made buffers stay fp32; and a
    transformers model built by a direct constructor call (wrong initial weights) is refused.
    """

    strategy_name = "zero_deepspeed"
    _hf_ds_config: Any = None
    # DeepSpeed's model-parallel groups for deepspeed.initialize (Ulysses: common.sequence_parallel.register), set by
    # the LightningModule's configure_model; Lightning's own call passes none.
    mpu: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warn_if_untested_lightning()
        super().__init__(*args, **kwargs)

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        if not self.zero_stage_3:
            with super().model_sharded_context():
                yield
            return
        self._init_config_if_needed()
        # transformers holds it through a weak reference: this attribute keeps it alive until teardown.
        self._hf_ds_config = HfDeepSpeedConfig(self.config)
        # zero.Init casts every floating tensor a constructor makes to the training dtype, buffers included:
        # RoPE's inverse frequencies from torch.arange would be rounded to bf16 (a quarter radian off by
        # position 256). transformers' shield for arange must be entered before Lightning's zero.Init.
        with prevent_arange_dtype_change(), super().model_sharded_context(), _refuse_unsharded_hf_init():
            yield

    def on_exception(self, exception: BaseException) -> None:
        # Before Lightning's teardown: a rank whose collective failed writes its hang report and stops the others
        # (common.hang); teardown itself may wait on the broken process group.
        report_failure(exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        # After the run a rank may load a model on its own (an export check): it must not partition then.
        self._hf_ds_config = None
        super().teardown()

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

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Back-propagate ``closure_loss`` with DeepSpeed's own division by the accumulation steps turned off.

        Under automatic optimization Lightning has already divided the loss by ``accumulate_grad_batches``
        (``ClosureResult``: ``closure_loss / normalize``); ``engine.backward``'s default ``scale_wrt_gas=True``
        would divide by the same number again and leave every gradient ``grad_accum`` times too small: clipping
        would act at ``grad_accum`` times its threshold, the logged gradient norm would be off by that factor,
        and SGD would step with that much less learning rate. Accelerate skips its own division under DeepSpeed
        for the same reason. Manual optimization divides nothing (Lightning refuses accumulation there), so
        DeepSpeed's division, by 1, stays. The micro-step count DeepSpeed keeps and the loss values are unchanged.
        """
        if self.lightning_module is not None and self.lightning_module.automatic_optimization:
            kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

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
        if not self._on_cpu and self.mpu is None:
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        # Lightning's own call, with the local rank on a CPU and the model-parallel groups when a recipe set them.
        model_parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=model_parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
            mpu=self.mpu,
        )
        return engine, ds_optimizer
