"""What a training process changes for the whole process, in one named call that prints it once at start.

Three settings outlive the call that makes them, so every entry point makes them visibly, at the top of ``main()``,
through :func:`setup_process`, and rank 0 prints one banner listing each, whether it is on, and its off switch:

- **hang detection** (:mod:`common.hang`): a watchdog thread per rank, ``faulthandler`` and an exception hook, so a
  stalled collective makes every rank write a report and end the run. Off: ``ZR_HANG_DETECTION=off``.
- **zero.Init keeps a given dtype**: DeepSpeed 0.19.8's ``zero.Init`` ignores an explicit dtype on CPUs without fp16
  kernels (:func:`keep_zero_init_dtype`); the class is patched for the process. Off: ``ZR_KEEP_ZERO_INIT_DTYPE=off``.
- **freed host memory kept** (:mod:`common.host_memory`): glibc's ``mallopt`` thresholds fixed for the process, so a
  step reuses what the step before freed; not under CPU/NVMe offload, where it raised the resident memory. Off:
  ``ZR_KEEP_FREED_MEMORY=off`` (``=on`` keeps it on offload runs too).

A fourth only when the DeepSpeed config asks for it (``comms_logger.enabled``): **communication log per step**
(:mod:`common.comms_log`), DeepSpeed's collectives cut at each optimizer step for ``summary.json``.

The factory's adapters (``common.strategy.lightning_trainer_kwargs``, ``accelerator_kwargs``) call
:func:`setup_process` too, so that a user's own script calling only them gets the same process; a second call
updates the hang settings and prints nothing.

Its pair, :func:`end_process_group`, is every entry point's last call: it ends the process group so that a finished
run on gloo (CPU) exits cleanly.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from common.comms_log import logs_communication, setup_comms_log
from common.host_memory import SWITCH_ENV as KEEP_FREED_MEMORY_ENV
from common.host_memory import keep_freed_memory, keeps_freed_memory_by_default, switch_setting, user_configured_malloc
from common.rundir import launcher_rank

ZERO_INIT_DTYPE_ENV = "ZR_KEEP_ZERO_INIT_DTYPE"  # "off" leaves DeepSpeed's zero.Init as it is
OFF_VALUES = ("off", "0", "false", "no")
# How long a finished gloo process lets its worker threads take the interpreter lock before it exits (see
# end_process_group). On 2 busy cores a quarter of this already sufficed for tests/distributed/exit_worker.py's
# 4 processes; the rest is margin, and a run does not notice it.
GLOO_RELEASE_PAUSE_S = 0.2


@dataclass(frozen=True)
class ProcessSetting:
    """One process-wide setting: its name, whether it is on, what it does, and the switch that flips it."""

    name: str
    on: bool
    effect: str
    switch: str

    def line(self) -> str:
        state = "on" if self.on else "off"
        flip = "off" if self.on else "on"
        return f"  {self.name}: {state} ({self.effect}); {flip}: {self.switch}"


@dataclass(frozen=True)
class ProcessSetup:
    """What :func:`setup_process` did to this process."""

    hang_detection: ProcessSetting
    zero_init_dtype: ProcessSetting
    freed_memory_kept: ProcessSetting
    communication_log: ProcessSetting | None = None  # only when the config's comms_logger asks for it

    @property
    def settings(self) -> tuple[ProcessSetting, ...]:
        optional = (self.communication_log,) if self.communication_log else ()
        return (self.hang_detection, self.zero_init_dtype, self.freed_memory_kept, *optional)

    def banner(self) -> str:
        """The lines rank 0 prints at start: every setting, whether it is on, and how to flip it."""
        return "\n".join(["process set-up (common.process_setup.setup_process):", *(s.line() for s in self.settings)])


def switched_off(name: str, environ: dict[str, str] | os._Environ = os.environ) -> bool:
    return environ.get(name, "").strip().lower() in OFF_VALUES


def keep_zero_init_dtype() -> bool:
    """Make ``deepspeed.zero.Init`` keep a dtype it is given (DeepSpeed 0.19.8, CPUs without fp16 kernels).

    ``Init._set_dtype`` computes ``dtype or torch.float16 if accelerator.is_fp16_supported() else torch.bfloat16 if
    ...``: by operator precedence an explicit ``dtype`` counts only where fp16 is supported. On a CPU without fp16
    (this AMD EPYC; the Intel Sapphire Rapids machines before it have it) every explicit fp32 request became bf16,
    the stage-3 engine's own included: fp32 ZeRO-3 with NVMe offload swapped bf16 weights and failed on its first
    forward ("self and mat2 must have the same dtype, but got Float and BFloat16"). The replacement gives ``dtype``
    precedence and leaves DeepSpeed's choice otherwise.

    Returns:
        Whether the patch is in place; False with ``ZR_KEEP_ZERO_INIT_DTYPE=off``. Calling it again changes nothing.
    """
    if switched_off(ZERO_INIT_DTYPE_ENV):
        return False
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time log must not reach a JSON stdout
        from deepspeed.runtime.zero.partition_parameters import Init

    if getattr(Init._set_dtype, "keeps_given_dtype", False):
        return True
    deepspeeds = Init._set_dtype

    def _set_dtype(self: Any, ds_config: Any, dtype: Any) -> None:
        if dtype is not None:
            self.dtype = dtype
        else:
            deepspeeds(self, ds_config, dtype)

    _set_dtype.keeps_given_dtype = True
    _set_dtype.deepspeeds = deepspeeds  # for the test that checks the upstream bug is still there
    Init._set_dtype = _set_dtype
    return True


def arm_hang_detection(timeout: timedelta | None, run_dir: str | Path | None) -> Path | None:
    """Make a stalled collective explain itself on every rank, then end the run (:mod:`common.hang`).

    Armed before the process group exists: ``timeout`` bounds every collective, and a hang's reports go to
    ``run_dir/hang/`` (``$ZR_HANG_DIR`` or ``./hang`` without a ``run_dir``). Returns that folder, or None when
    ``ZR_HANG_DETECTION=off`` leaves it out.
    """
    from common.hang import detection_enabled, enable_hang_detection, settings_for  # imports torch: not for the tools

    enable_hang_detection(timeout, run_dir)
    return settings_for(timeout, run_dir).hang_dir if detection_enabled() else None


def allocator_setting(kept: bool, offload: bool, environ: dict[str, str] | os._Environ = os.environ) -> ProcessSetting:
    """The banner's allocator line: why it is on or off, and the value of ``ZR_KEEP_FREED_MEMORY`` that flips it."""
    if kept:
        effect = "glibc's mallopt thresholds fixed: a step reuses what the last one freed"
        return ProcessSetting("freed host memory kept", True, effect, f"{KEEP_FREED_MEMORY_ENV}=off")
    if user_configured_malloc(environ):
        effect = "your MALLOC_*, GLIBC_TUNABLES or LD_PRELOAD allocator settings decide"
        return ProcessSetting("freed host memory kept", False, effect, f"unset them and {KEEP_FREED_MEMORY_ENV}=on")
    if switch_setting(environ) is False:
        effect = f"{KEEP_FREED_MEMORY_ENV}=off: glibc's defaults"
    elif offload:
        effect = "offload run: glibc's defaults, resident memory falls back after the peak"
    else:
        effect = "not glibc's malloc"
    return ProcessSetting("freed host memory kept", False, effect, f"{KEEP_FREED_MEMORY_ENV}=on")


_ANNOUNCED = False


def announce_once(setup: ProcessSetup) -> None:
    """Print the banner to stderr once per process, on the launcher's rank 0 only."""
    global _ANNOUNCED
    if _ANNOUNCED:
        return
    _ANNOUNCED = True
    if launcher_rank() == 0:
        print(setup.banner(), file=sys.stderr, flush=True)


def communication_log_setting(ds_config: dict[str, Any]) -> ProcessSetting | None:
    """Log DeepSpeed's collectives per optimizer step (common.comms_log) when the config's ``comms_logger`` is on."""
    if not logs_communication(ds_config):
        return None
    setup_comms_log()
    return ProcessSetting(
        "communication log per step",
        True,
        "DeepSpeed's comms_logger on, DeepSpeedEngine._take_model_step wrapped; summary.json gets 'communication'",
        "comms_logger.enabled=false",
    )


def setup_process(
    ds_config: dict[str, Any],
    timeout: timedelta | None = None,
    run_dir: str | Path | None = None,
    announce: bool = True,
) -> ProcessSetup:
    """Make this process's process-wide settings for a run of ``ds_config`` and print them once (rank 0).

    Args:
        ds_config: the factory's resolved DeepSpeed config (offload decides the allocator's default).
        timeout: how long a collective may wait (the recipes' ``collective_timeout_s``); torch's 30 min if None.
        run_dir: the run directory; a hang's reports go to ``run_dir/hang/``.
        announce: print the banner (once per process, rank 0 only).

    Returns:
        What was done: each setting, on or off, and its switch.
    """
    hang_dir = arm_hang_detection(timeout, run_dir)
    zero_init = keep_zero_init_dtype()
    offload = not keeps_freed_memory_by_default(ds_config)
    kept = keep_freed_memory(by_default=not offload)
    setup = ProcessSetup(
        hang_detection=ProcessSetting(
            "hang detection",
            hang_dir is not None,
            f"a watchdog thread; a stalled collective writes reports to {hang_dir} and ends the run"
            if hang_dir
            else "ZR_HANG_DETECTION=off",
            "ZR_HANG_DETECTION=off" if hang_dir else "unset ZR_HANG_DETECTION",
        ),
        zero_init_dtype=ProcessSetting(
            "zero.Init keeps a given dtype",
            zero_init,
            "DeepSpeed's Init._set_dtype patched for CPUs without fp16"
            if zero_init
            else f"{ZERO_INIT_DTYPE_ENV}=off: DeepSpeed's own",
            f"{ZERO_INIT_DTYPE_ENV}=off" if zero_init else f"unset {ZERO_INIT_DTYPE_ENV}",
        ),
        freed_memory_kept=allocator_setting(kept, offload),
        communication_log=communication_log_setting(ds_config),
    )
    if announce:
        announce_once(setup)
    return setup


def end_process_group() -> None:
    """A finished run's last call: destroy the process group and, on gloo, let its worker threads finish.

    gloo runs each collective on a worker thread of its own, and that thread lets go of the collective's tensors a
    moment after the caller's ``wait`` returned. A tensor Python no longer holds is freed then, and freeing it needs
    the interpreter lock. If the process is already shutting down by then, the thread cannot take the lock, and the
    process aborts ("terminate called without an active exception", SIGABRT) after a healthy run; the launcher then
    reports the whole run as failed. ``destroy_process_group`` does not stop those threads while DeepSpeed or FSDP2
    still hold the group (they keep it in their own objects), so the main thread sleeps here, without the lock,
    for :data:`GLOO_RELEASE_PAUSE_S`. Nothing may use the process group after this call.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    on_gloo = "gloo" in str(dist.get_backend())
    dist.destroy_process_group()
    if on_gloo:
        time.sleep(GLOO_RELEASE_PAUSE_S)
