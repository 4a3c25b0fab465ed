"""Config linter: known ZeRO pitfalls (docs/design.md), those found here and upstream, each with its fix.

``zero-recipes lint CONFIG`` reads a recipe YAML, a DeepSpeed JSON or an accelerate YAML, normalises
it into a :class:`LintView` (the DeepSpeed dict, the recipe config dict or None, the source kind, the
installed versions and whatever is known of the model), and runs every rule of :data:`RULES` on it.
A rule is a small pure function ``(view) -> list[Finding]``; tests build views directly. The rules live in one
module per topic (:mod:`common.lint.memory`, ``precision``, ``offload``, ``parallel``, ``checkpoints``,
``versions``, ``frontends``, ``network``, ``peer``), each with its own ``RULES`` dict; :data:`RULES` here joins them
(a new topic module is one more line there).

Severities: ``error`` (the run fails or silently does the wrong thing; exit code 1), ``warning``
(costs memory, speed or accuracy; fix it or know why not), ``info`` (worth knowing, nothing to fix:
shipped presets may carry info findings on purpose, e.g. ``round_robin_gradients`` in ``science``).

Every recipe lints its resolved config at start (docs/tools.md)::

    findings = lint_run(ds_config, config_to_dict(cfg), backend="lightning", hidden_size=hidden,
                        world_size=world_size, ranks_per_node=devices)
    if rank0:
        print_findings(findings)
    if has_errors(findings):
        raise ConfigError("the config linter found errors (above); docs/tools.md lists the rules")
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, TextIO

from common.errors import ConfigError
from common.lint import checkpoints, frontends, memory, network, offload, parallel, peer, precision, versions
from common.lint.view import BACKENDS, SEVERITIES, SEVERITY_ORDER, SOURCE_KINDS, Finding, LintView, Rule
from common.machine import available_host_ram, local_device_memory

# What callers import from here: the view and findings, the joined rules, and the entry points below.
__all__ = [
    "BACKENDS",
    "RULES",
    "SEVERITIES",
    "SEVERITY_ORDER",
    "SOURCE_KINDS",
    "Finding",
    "LintView",
    "Rule",
    "actionable",
    "format_finding",
    "has_errors",
    "installed_versions",
    "lint_at_start",
    "lint_run",
    "print_findings",
    "run_rules",
]

# Every rule, by topic: the topic modules' own dicts joined (a rule id is unique across them).
RULES: dict[str, Rule] = {
    **frontends.RULES,
    **memory.RULES,
    **precision.RULES,
    **checkpoints.RULES,
    **offload.RULES,
    **parallel.RULES,
    **versions.RULES,
    **network.RULES,
    **peer.RULES,
}


def fsdp2_run(view: LintView) -> list[Finding]:
    """The one finding for an FSDP2 preset's config: the rules here read DeepSpeed's settings, which it has none of."""
    return [
        Finding(
            "fsdp2-preset",
            "info",
            f"preset {view.ds_config['fsdp2']['preset']} runs on torch's FSDP2, not DeepSpeed: the ZeRO rules do not "
            "apply, and FSDP2's own checks are not written yet",
            f"to have the ZeRO rules check the run, use preset={view.ds_config['fsdp2']['counterpart']}",
        )
    ]


def run_rules(view: LintView, rules: dict[str, Rule] | None = None) -> list[Finding]:
    """Every rule on ``view``, findings sorted errors first."""
    if view.ds_config and "fsdp2" in view.ds_config:  # an FSDP2 run config (common.fsdp2), no DeepSpeed keys
        return fsdp2_run(view)
    findings: list[Finding] = []
    for rule in (rules or RULES).values():
        findings += rule(view)
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


def has_errors(findings: list[Finding]) -> bool:
    """Whether any finding is an error (``zero-recipes lint`` then exits 1)."""
    return any(f.severity == "error" for f in findings)


def actionable(findings: list[Finding]) -> list[Finding]:
    """Errors and warnings: what "no finding on a shipped preset" counts (info is documentation)."""
    return [f for f in findings if f.severity != "info"]


def installed_versions() -> dict[str, str]:
    """Installed PyTorch and DeepSpeed versions (package metadata, no import), and NCCL's on a GPU."""
    from importlib import metadata

    versions = {}
    for package in ("torch", "deepspeed"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    try:
        import torch

        if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
            versions["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # no torch or no NCCL: nothing to check
        pass
    return versions


def _local_memory(ranks_per_node: int) -> tuple[float, str] | None:
    """What one rank has on this machine (:func:`common.machine.local_device_memory`); None when unknown."""
    try:
        return local_device_memory(ranks_per_node)
    except Exception:  # no psutil, or a GPU that cannot be queried: the check is skipped
        return None


def _local_accelerator() -> str:
    """``cuda`` when this machine has a GPU PyTorch can use, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _world_from_ds(ds_config: dict[str, Any]) -> int:
    total, micro, accum = (
        ds_config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    )
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (total, micro, accum)):
        return max(1, total // (micro * accum))
    return 1


def lint_run(
    ds_config: dict[str, Any] | None,
    recipe_config: dict[str, Any] | None = None,
    *,
    backend: str | None = None,
    num_params: int | None = None,
    hidden_size: int | None = None,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    versions: dict[str, str] | None = None,
    accelerator: str | None = None,
) -> list[Finding]:
    """Lint a run as a recipe is about to start it: its resolved DeepSpeed dict and its config as a dict.

    Args:
        ds_config: the factory's resolved dict (``resolve_ds_config(cfg, world_size)``).
        recipe_config: ``common.config.config_to_dict(cfg)``.
        backend: ``lightning`` or ``accelerate`` (the resolved dict is the full one either way: the Lightning
            adapter removes what Lightning refuses, so ``grad-accum-in-lightning-dict`` does not fire here).
        num_params: the model's parameter count (checks pinned offload memory against host RAM).
        hidden_size: the model's hidden size (persistence threshold and bucket checks).
        world_size: data-parallel ranks (default: from the batch sizes in ``ds_config``).
        ranks_per_node: processes per node (default: ``world_size``).
        versions: installed versions (default: :func:`installed_versions`).
        accelerator: ``cuda`` or ``cpu`` (default: what this machine has: the run is here).

    Returns:
        Findings, errors first. Print them with :func:`print_findings`.
    """
    world = world_size or (_world_from_ds(ds_config) if ds_config else 1)
    view = LintView(
        ds_config=ds_config,
        recipe_config=recipe_config,
        source_kind="run",
        versions=installed_versions() if versions is None else versions,
        backend=backend,
        hidden_size=hidden_size,
        num_params=num_params,
        world_size=world,
        ranks_per_node=ranks_per_node or world,
        host_ram_bytes=available_host_ram(),
        local_memory=_local_memory(ranks_per_node or world),
        accelerator=accelerator or _local_accelerator(),
    )
    return run_rules(view)


def format_finding(finding: Finding) -> str:
    """``error [rule-id] message`` and an indented ``fix:`` line."""
    return f"{finding.severity:<7} [{finding.rule_id}] {finding.message}\n        fix: {finding.fix}"


def print_findings(findings: list[Finding], file: TextIO | None = None, prefix: str = "lint: ") -> None:
    """Print findings (or one line saying there are none) for a person reading the run's log."""
    out = file or sys.stderr
    if not findings:
        print(f"{prefix}no findings", file=out, flush=True)
        return
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    summary = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n)
    print(f"{prefix}{summary}", file=out)
    for finding in findings:
        print(format_finding(finding), file=out)
    out.flush()


def lint_at_start(
    ds_config: dict[str, Any],
    recipe_config: dict[str, Any],
    hidden_size: int | None = None,
    world_size: int | None = None,
) -> list[Finding]:
    """What every recipe calls when it has resolved its DeepSpeed dict: lint, print, refuse on errors.

    Findings are printed by the launcher's rank 0 only (every rank lints, so every rank refuses alike).

    Raises:
        ConfigError: when a rule reports an error.
    """
    from common.rundir import is_launcher_rank_zero

    world = world_size or _world_from_ds(ds_config)
    per_node = max(1, world // (recipe_config.get("num_nodes") or 1))  # the network rules count nodes
    findings = lint_run(ds_config, recipe_config, hidden_size=hidden_size, world_size=world, ranks_per_node=per_node)
    if is_launcher_rank_zero():
        print_findings(findings)
    if has_errors(findings):
        first = next(f for f in findings if f.severity == "error")
        raise ConfigError(f"config linter: [{first.rule_id}] {first.message} (fix: {first.fix})")
    return findings
