"""``zero-recipes lint``: read a config file (a recipe YAML, a DeepSpeed JSON, an accelerate YAML, a run
directory), build the :class:`common.lint.LintView` it describes and run the rules of :mod:`common.lint`.

A recipe YAML is read by its recipe: ``--describe`` (:mod:`common.tools.recipes`) gives the resolved config, the
world size, the DeepSpeed dict and the model facts, all from the recipe's own process.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from common.communication import parse_link
from common.config import parse_overrides, read_yaml
from common.errors import ConfigError, InputMissing
from common.lint import (
    BACKENDS,
    SEVERITY_ORDER,
    Finding,
    LintView,
    _local_memory,
    _world_from_ds,
    has_errors,
    installed_versions,
    print_findings,
    run_rules,
)
from common.machine import available_host_ram, local_device_memory
from common.memory_formulas import facts_from_hf_config, parse_bytes, parse_count
from common.strategy import RunFacts, resolve_deepspeed_config
from common.tools.recipes import REPO_ROOT, describe, find_recipe, recipe_of_config

# --- reading files ------------------------------------------------------------------------------------


def _invalid(message: str) -> Finding:
    return Finding(
        "config-invalid", "error", message, "fix the value the message names (zero-recipes ls lists presets)"
    )


def _recipe_view(
    path: Path, data: dict[str, Any], recipe: str | None, hidden: int | None, params: int | None, model: Any
) -> tuple[LintView, list[Finding]]:
    """The run a recipe YAML describes: the recipe's own ``--describe`` of it, or the factory's reading of its keys
    when the file belongs to no recipe."""
    view = LintView(
        ds_config=None,
        recipe_config=dict(data),
        source_kind="recipe",
        path=str(path),
        hidden_size=hidden,
        num_params=params,
        model=model,
    )
    owner = find_recipe(recipe) if recipe else recipe_of_config(path)
    if owner is None:
        return view, _factory_view(view, path, data, hidden)
    try:
        run = describe(owner, path)
    except InputMissing as exc:  # the model is not made yet: the config can still be checked on its own
        return view, _factory_view(view, path, data, hidden, why=f"{exc}; linted without the model's facts")
    except ConfigError as exc:  # the recipe refuses the file: the rules still read its keys
        return view, [_invalid(str(exc))]
    view.recipe_config = run.config
    view.world_size, view.ranks_per_node = run.world_size, run.devices_per_node
    view.model = view.model or run.model
    view.hidden_size = view.hidden_size or view.model.hidden_size
    view.num_params = view.num_params or view.model.num_params
    view.ds_config = run.ds_config
    return view, []


def _factory_view(
    view: LintView, path: Path, data: dict[str, Any], hidden: int | None, why: str | None = None
) -> list[Finding]:
    """A recipe-shaped YAML resolved by the DeepSpeed factory alone (no model facts): it belongs to no known
    recipe, or (``why``) its recipe could not describe the run because the model is not there yet."""
    if why:
        finding = Finding("recipe-input-missing", "info", why, "create the model first for the model-based checks")
    else:
        finding = Finding(
            "recipe-unknown",
            "info",
            f"{path} lies in no recipe's configs/ folder: linted with the DeepSpeed factory alone, without the "
            "recipe's model and its own DeepSpeed settings",
            "pass --recipe NAME (zero-recipes ls) or the folder of a copy for the recipe's view",
        )
    findings = [finding]
    try:
        facts = RunFacts(
            world_size=max(1, int(data.get("devices") or 1)) * int(data.get("num_nodes") or 1),
            micro_batch_size=int(data.get("micro_batch_size", 1)),
            grad_accum=int(data.get("grad_accum", 1)),
            precision=data.get("precision"),
            hidden_size=hidden,
        )
        view.ds_config = resolve_deepspeed_config(
            data.get("preset", "deepspeed_stage_2"), facts, parse_overrides(data.get("ds_overrides") or [])
        )
        view.world_size = facts.world_size
    except (ConfigError, ValueError, TypeError) as exc:
        findings.append(_invalid(f"{path}: {exc}"))
    return findings


def _accelerate_view(path: Path, data: dict[str, Any]) -> tuple[LintView, list[Finding]]:
    findings: list[Finding] = []
    dsc = data.get("deepspeed_config") or {}
    processes = int(data.get("num_processes") or 1)
    machines = int(data.get("num_machines") or 1)
    view = LintView(
        ds_config=None,
        source_kind="accelerate",
        backend="accelerate",
        accelerate_config=data,
        path=str(path),
        world_size=processes,
        ranks_per_node=max(1, processes // machines),
    )
    if data.get("distributed_type") not in (None, "DEEPSPEED"):
        return view, findings
    file = dsc.get("deepspeed_config_file")
    if file:
        candidates = (
            [Path(file)] if Path(file).is_absolute() else [Path.cwd() / file, path.parent / file, REPO_ROOT / file]
        )
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            findings.append(
                Finding(
                    "config-not-found",
                    "info",
                    f"deepspeed_config_file {file!r} is not found from here, so its DeepSpeed settings are not "
                    "checked (accelerate launch resolves it relative to the directory it is started from)",
                    f"lint the JSON itself (zero-recipes lint {file}), or run the linter from the launch directory",
                )
            )
            return view, findings
        try:
            view.ds_config = json.loads(found.read_text())
        except json.JSONDecodeError as exc:
            findings.append(_invalid(f"{found}: not valid JSON ({exc.msg}, line {exc.lineno})"))
        return view, findings
    zero: dict[str, Any] = {"stage": dsc.get("zero_stage", 0)}
    for section, key in (("offload_optimizer", "offload_optimizer_device"), ("offload_param", "offload_param_device")):
        if dsc.get(key) not in (None, "none"):
            zero[section] = {"device": dsc[key], "nvme_path": dsc.get(f"{key.split('_device')[0]}_nvme_path")}
    mixed = str(data.get("mixed_precision", "no"))
    view.ds_config = {
        "zero_optimization": zero,
        "bf16": {"enabled": mixed == "bf16"},
        "fp16": {"enabled": mixed == "fp16"},
    }
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if key in dsc:
            view.ds_config[key] = dsc[key]
    return view, findings


def lint_file(
    path: str | Path,
    *,
    recipe: str | None = None,
    backend: str | None = None,
    hidden_size: int | None = None,
    num_params: int | None = None,
    model: Any = None,
    versions: dict[str, str] | None = None,
    device_memory_bytes: float | None = None,
    network: str | None = None,
    nodes: int | None = None,
    host_memory_bytes: float | None = None,
) -> list[Finding]:
    """Lint a recipe YAML, a DeepSpeed JSON or an accelerate YAML.

    Args:
        path: the file.
        recipe: the recipe a YAML belongs to, a name or a copy's folder (default: the recipe whose ``configs/``
            folder holds the file; a YAML outside any is read by the factory alone).
        backend: who will consume a DeepSpeed JSON (``lightning``, ``accelerate``, ``hf_trainer``).
        hidden_size: the model's hidden size, when the file does not say.
        num_params: the model's parameter count, when the file does not say.
        model: :class:`common.memory_formulas.ModelFacts` (from ``--model-config``).
        versions: installed versions (default: :func:`installed_versions`).
        device_memory_bytes: memory of one target device for the activation check (default: the local GPU's;
            without a GPU the check is skipped, since a config meant for GPUs says nothing about a laptop's RAM).
        network: the link the data-parallel group crosses (``common.communication.parse_link``), for the network
            rules; None skips them.
        nodes: nodes the ranks are spread over (default: a DeepSpeed JSON's ranks on one node, a recipe's own).
        host_memory_bytes: host RAM per node (default: what this machine has available).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if model is not None:
        hidden_size = hidden_size or model.hidden_size
        num_params = num_params or model.num_params
    findings: list[Finding] = []
    if path.suffix == ".json":
        if recipe:
            raise ConfigError(f"--recipe applies to a recipe YAML, not to a DeepSpeed JSON ({path})")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            return [_invalid(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})")]
        if not isinstance(data, dict):
            return [_invalid(f"{path}: expected a JSON object")]
        view = LintView(
            ds_config=data,
            source_kind="deepspeed",
            backend=backend,
            path=str(path),
            world_size=_world_from_ds(data),
            ranks_per_node=_world_from_ds(data),
        )
    else:
        data = read_yaml(path)
        if "distributed_type" in data or "compute_environment" in data:
            for value, option in ((recipe, "--recipe"), (backend, "--backend")):
                if value:
                    raise ConfigError(
                        f"{option} applies to a recipe YAML or a DeepSpeed JSON, not to an accelerate YAML ({path}), "
                        "which Accelerate consumes with the DeepSpeed JSON it names"
                    )
            view, findings = _accelerate_view(path, data)
        else:
            view, findings = _recipe_view(path, data, recipe, hidden_size, num_params, model)
            view.backend = backend
    view.hidden_size = view.hidden_size or hidden_size
    view.num_params = view.num_params or num_params
    view.model = view.model or model
    view.versions = installed_versions() if versions is None else versions
    view.host_ram_bytes = available_host_ram() if host_memory_bytes is None else host_memory_bytes
    view.device_memory_bytes = device_memory_bytes
    view.network = parse_link(network) if network else None
    if nodes is not None:
        if nodes < 1 or view.world_size % nodes:
            raise ConfigError(f"--nodes must divide the {view.world_size} ranks of {path}, got {nodes}")
        view.ranks_per_node = view.world_size // nodes
    # A file may be meant for another machine: without --gpu-memory, a bucket is checked against this machine's
    # whole device (or whole host RAM on a CPU), the bound that no rank of it can exceed.
    view.local_memory = _local_memory(1)
    if (
        device_memory_bytes is None
        and view.model is not None
        and view.source_kind == "recipe"
        and torch.cuda.is_available()
    ):
        view.device_memory_bytes = local_device_memory(view.ranks_per_node)[0]
    return sorted(findings + run_rules(view), key=lambda f: SEVERITY_ORDER[f.severity])


# --- the `zero-recipes lint` command ------------------------------------------------------------------


def register(sub: Any) -> None:
    """Add ``zero-recipes lint`` to the CLI's subparsers."""
    p = sub.add_parser(
        "lint",
        help="check a recipe YAML, DeepSpeed JSON or accelerate YAML for known ZeRO pitfalls",
        description="Check a config for known ZeRO pitfalls and upstream ones; each finding names its rule, "
        "severity and fix. Exit code 1 when there is an error.",
    )
    p.add_argument("config", help="recipe YAML, DeepSpeed JSON or accelerate YAML")
    p.add_argument(
        "--recipe",
        default=None,
        help="the recipe a YAML belongs to: a name or a copy's folder (default: the recipe whose configs/ holds it)",
    )
    p.add_argument("--backend", choices=BACKENDS, default=None, help="who consumes a DeepSpeed JSON")
    p.add_argument("--hidden-size", type=int, default=None, help="the model's hidden size")
    p.add_argument("--params", default=None, help="the model's parameter count, e.g. 7e9")
    p.add_argument("--model-config", default=None, help="a Hugging Face config.json (hidden size and parameters)")
    p.add_argument(
        "--gpu-memory", default=None, help="memory per device for the activation check, e.g. 80GB (default: local GPU)"
    )
    p.add_argument(
        "--network",
        default=None,
        help="the link the data-parallel group crosses (nvlink, pcie3/4/5, 25gbps/100gbps/400gbps or a figure such "
        "as 12.5GB/s): stage 3 over a slow network, buckets out of scale with the link",
    )
    p.add_argument("--nodes", type=int, default=None, help="nodes the ranks of a DeepSpeed JSON are spread over")
    p.add_argument("--host-memory", default=None, help="host RAM per node (default: what this machine has available)")
    p.add_argument("--json", action="store_true", help="print findings as JSON")
    p.set_defaults(func=cmd_lint)


def cmd_lint(args: Any) -> int:
    """``zero-recipes lint``: print findings, exit 1 on errors."""
    model = facts_from_hf_config(args.model_config) if args.model_config else None
    findings = lint_file(
        args.config,
        recipe=args.recipe,
        backend=args.backend,
        hidden_size=args.hidden_size,
        num_params=parse_count(args.params) if args.params else None,
        model=model,
        device_memory_bytes=parse_bytes(args.gpu_memory) if args.gpu_memory else None,
        network=args.network,
        nodes=args.nodes,
        host_memory_bytes=parse_bytes(args.host_memory) if args.host_memory else None,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "config": args.config,
                    "findings": [asdict(f) for f in findings],
                    "errors": sum(f.severity == "error" for f in findings),
                },
                indent=2,
            )
        )
    else:
        print_findings(findings, file=sys.stdout, prefix=f"{args.config}: ")
    return 1 if has_errors(findings) else 0
