"""What a recipe tells the tools about a run without training it: ``train.py --describe`` prints it as JSON.

The tools (``zero-recipes estimate --recipe``, ``probe``, ``lint --recipe``) never import a recipe: they run
its entry point with ``--describe`` (any ``--config`` and ``key=value`` the user gave) and read one JSON object
from its stdout. Each recipe has one explicit ``describe(cfg) -> RecipeDescription`` function and passes it
to :func:`common.config.parse_recipe_args`; a recipe copied elsewhere by ``zero-recipes cp`` keeps working
with every tool because the contract is the command line, not a module layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from common.config import config_to_dict
from common.memory_formulas import ModelFacts


@dataclass
class RecipeDescription:
    """One run of a recipe as the planning tools see it.

    Attributes:
        recipe: the recipe's name (``nlp``, ``nlp:finetune``, ``cv``, ``science``).
        config: the resolved config (``common.config.config_to_dict``).
        world_size: ranks in the run (devices per node x nodes).
        devices_per_node: ranks on one node (``devices``; 0 resolved to the local GPUs, or 2 on a CPU).
        num_nodes: nodes.
        ds_config: the factory's resolved DeepSpeed dict for this run.
        model: the planner's model facts, counted on the meta device (no weights read, no memory used).
        seq_len: tokens per sample for the activation estimate; None when the model is not a sequence model.
        micro_batch_size: samples per rank per forward pass.
        persistent_params: parameter elements ZeRO-3 keeps whole on every rank (under
            ``stage3_param_persistence_threshold``; 0 below stage 3).
        parallel_components: ``deepspeed`` when the recipe runs tensor, pipeline, expert and sequence parallelism
            with DeepSpeed's own components (``common.parallel.ParallelLayout.components``): the planner then refuses
            the combinations the recipe refuses.
    """

    recipe: str
    config: dict[str, Any]
    world_size: int
    devices_per_node: int
    num_nodes: int
    ds_config: dict[str, Any]
    model: ModelFacts
    seq_len: int | None
    micro_batch_size: int
    persistent_params: int = 0
    parallel_components: str = "any"

    @classmethod
    def of(
        cls,
        recipe: str,
        cfg: Any,
        ds_config: dict[str, Any],
        model: ModelFacts,
        *,
        seq_len: int | None,
        parallel_components: str = "any",
    ) -> RecipeDescription:
        """The description of a recipe's run: what every recipe derives the same way is derived here.

        Args:
            recipe: the recipe's name.
            cfg: the recipe's config dataclass (its ``devices``, ``num_nodes`` and ``micro_batch_size`` are read; all
                of it is recorded).
            ds_config: the factory's resolved DeepSpeed dict for this run.
            model: the model facts the recipe counted.
            seq_len: tokens per sample; None when the model is not a sequence model.
            parallel_components: see the class's attributes.

        Returns:
            The description, with the world size (devices x nodes, :func:`local_world`) and the parameters ZeRO-3
            keeps whole on every rank (:func:`persistent_elements`) filled in.
        """
        devices_per_node, num_nodes = local_world(cfg.devices, cfg.num_nodes)
        return cls(
            recipe=recipe,
            config=config_to_dict(cfg),
            world_size=devices_per_node * num_nodes,
            devices_per_node=devices_per_node,
            num_nodes=num_nodes,
            ds_config=ds_config,
            model=model,
            seq_len=seq_len,
            micro_batch_size=cfg.micro_batch_size,
            persistent_params=persistent_elements(model.param_numels, ds_config),
            parallel_components=parallel_components,
        )

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["model"]["param_numels"] = list(self.model.param_numels)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RecipeDescription:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        model = dict(values["model"])
        model["param_numels"] = tuple(model.get("param_numels") or ())
        values["model"] = ModelFacts(**model)
        return cls(**values)


def local_world(devices: int, num_nodes: int) -> tuple[int, int]:
    """(devices per node, nodes) the way every recipe resolves ``devices``: 0 is every local GPU, or 2 CPU
    processes without one."""
    import torch

    if devices:
        return devices, num_nodes
    return (torch.cuda.device_count() if torch.cuda.is_available() else 2), num_nodes


def persistent_elements(param_numels: tuple[int, ...] | list[int], ds_config: dict[str, Any]) -> int:
    """Elements of the parameters ZeRO-3 keeps whole on every rank (DeepSpeed's rule: numel <= threshold)."""
    zero = ds_config.get("zero_optimization", {})
    if int(zero.get("stage", 0)) != 3:
        return 0
    threshold = int(zero.get("stage3_param_persistence_threshold", 100_000))
    return sum(n for n in param_numels if n <= threshold)
