"""The ``zero-recipes`` command.

    zero-recipes ls                                   presets and recipes, one line each
    zero-recipes config nlp --world-size 8 --micro-batch-size 4 --hidden-size 4096
    zero-recipes config cv --format accelerate --out my_run/     writes accelerate.yaml + ds_config.json

Bad input (unknown preset or key, a stage outside 0-3, fp16 with ``science``, NVMe without a path,
a value that is not a number) prints one ``error:`` line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from common.config import parse_overrides
from common.errors import USAGE_EXIT_CODE, ConfigError, exit_on_user_error
from common.presets import FSDP2_PRESETS, PRESETS
from common.rundir import refuse_file_as_out_dir
from common.strategy import PRECISIONS, RunFacts, resolve_deepspeed_config, write_accelerate_files
from common.tools import copy_recipe, doctor, export, lint, memory, probe
from common.tools.options import positive_int
from common.tools.recipes import shipped_recipes


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2), not a usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message} (see: {self.prog} --help)", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)


def cmd_ls(args: argparse.Namespace) -> int:
    """Print presets and recipes with their one-line why (the recipes need the source checkout)."""
    width = max(len(name) for name in [*PRESETS, *FSDP2_PRESETS])
    print("presets (zero-recipes config PRESET):")
    for name, spec in PRESETS.items():
        print(f"  {name:<{width}}  stage {spec['stage']}  {spec['why']}")
    for name, spec in FSDP2_PRESETS.items():  # torch's FSDP2: the peer each is measured against
        print(f"  {name:<{width}}  FSDP2    {spec['why']}")
    sys.stdout.flush()  # the presets stay above the error line of an installation without recipes
    recipes = shipped_recipes()
    print("recipes (python recipes/NAME/train.py; NAME:ENTRY runs recipes/NAME/ENTRY.py):")
    for recipe in recipes:
        configs = ", ".join(p.stem for p in recipe.configs())
        print(f"  {recipe.name:<{width}}  {recipe.summary()}  [configs: {configs}]")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved DeepSpeed JSON, or write the accelerate YAML + JSON pair."""
    facts = RunFacts.from_fields(args, args.world_size, args.hidden_size)
    ds_config = resolve_deepspeed_config(args.preset, facts, parse_overrides(args.set))
    if args.nvme_path and not nvme_offloaded(ds_config):
        raise ConfigError(
            f"--nvme-path applies to NVMe offload (the *_offload_nvme presets, or --set "
            f"zero_optimization.offload_optimizer.device=nvme), not to preset {args.preset}, which offloads nothing "
            "to NVMe"
        )
    if args.format == "deepspeed" and not args.out:
        print(json.dumps(ds_config, indent=2))
        return 0
    if not args.out:
        raise ConfigError("--format accelerate writes two files: pass --out DIR")
    out = Path(args.out)
    if args.format == "deepspeed":
        out.mkdir(parents=True, exist_ok=True)
        (out / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
        print(out / "ds_config.json")
        return 0
    yaml_path = write_accelerate_files(ds_config, out, num_processes=args.world_size)
    print(yaml_path)
    print(yaml_path.parent / "ds_config.json")
    return 0


def nvme_offloaded(ds_config: dict) -> bool:
    """Whether a resolved DeepSpeed config offloads the optimizer states or the parameters to NVMe."""
    zero = ds_config.get("zero_optimization") or {}
    return any((zero.get(section) or {}).get("device") == "nvme" for section in ("offload_optimizer", "offload_param"))


def build_parser() -> argparse.ArgumentParser:
    """The ``zero-recipes`` argument parser with all subcommands."""
    parser = _Parser(prog="zero-recipes", description="DeepSpeed ZeRO recipes on Lightning and Accelerate.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    ls = sub.add_parser("ls", help="list presets and recipes")
    ls.set_defaults(func=cmd_ls)

    config = sub.add_parser("config", help="print a preset's resolved DeepSpeed config")
    config.add_argument("preset", help="preset name (zero-recipes ls)")
    config.add_argument("--world-size", type=positive_int, default=1, help="data-parallel ranks in total")
    config.add_argument("--micro-batch-size", type=positive_int, default=1, help="samples per rank per step")
    config.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    config.add_argument("--precision", choices=PRECISIONS, default=None, help="default: the preset's (bf16)")
    config.add_argument("--hidden-size", type=positive_int, default=None, help="model hidden size (scales buckets)")
    config.add_argument("--gradient-clipping", type=float, default=1.0, help="max grad norm, 0 = off")
    config.add_argument("--nvme-path", default=None, help="NVMe folder for the *_offload_nvme presets")
    config.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="DeepSpeed key, e.g. zero_optimization.stage=2"
    )
    config.add_argument("--format", choices=("deepspeed", "accelerate"), default="deepspeed")
    config.add_argument("--out", default=None, help="write files to this folder instead of printing")
    config.set_defaults(func=cmd_config)

    for register in EXTRA_COMMANDS:
        register(sub)
    return parser


# The other tools add their subcommands here: (subparsers) -> None.
EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    copy_recipe.register,
    memory.register,
    lint.register,
    probe.register,
    export.register,
    doctor.register,
]


class _DropCpuAcceleratorNotice(logging.Filter):
    """DeepSpeed logs "Setting accelerator to CPU" when it is first imported on a machine without a GPU.

    The tools import it only to validate a config against DeepSpeed's own schema (``config``, ``lint``,
    ``estimate``): that line would be the only thing on their stderr, and it says nothing about their answer.
    Training runs do not go through this command, so they keep the notice.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Setting accelerator to CPU")


def quiet_deepspeed_cpu_notice() -> None:
    """Drop DeepSpeed's CPU-accelerator notice in this process; DeepSpeed's other messages still print.

    A filter on the ``DeepSpeed`` logger set before DeepSpeed is imported survives its set-up (which sets the
    level and adds a handler, and keeps filters).
    """
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropCpuAcceleratorNotice) for f in logger.filters):
        logger.addFilter(_DropCpuAcceleratorNotice())


# Arguments that name a folder a command writes into (as the user typed them): one that is an existing file is
# refused for every command, before the command runs.
OUTPUT_FOLDER_ARGS = {"out": "--out", "out_dir": "OUT_DIR", "dest": "DEST"}


@exit_on_user_error()
def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``zero-recipes`` console script."""
    quiet_deepspeed_cpu_notice()
    args = build_parser().parse_args(argv)
    for attribute, name in OUTPUT_FOLDER_ARGS.items():
        if getattr(args, attribute, None):
            refuse_file_as_out_dir(getattr(args, attribute), name)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
