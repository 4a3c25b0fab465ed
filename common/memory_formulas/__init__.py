"""The ZeRO memory formulas and the model facts they need: pure arithmetic, no DeepSpeed, no recipe, no
reads of this machine (:mod:`common.machine` has those).

The planner (``zero-recipes estimate``, :mod:`common.tools.memory`) builds its table from these, the linter's
rules (:mod:`common.lint`) check configs with them, and a recipe's ``--describe`` reports its model with
:func:`facts_from_model_config` / :func:`count_module`. See :mod:`common.tools.memory` for what each term is.

One module per topic: :mod:`~common.memory_formulas.model_facts` (what a model is), ``model_states`` (parameters,
gradients and optimizer states per rank), ``activations``, ``offload`` (bytes moved per step and their time) and
``units`` (parsing and formatting sizes); ``fsdp2`` holds the same terms for the FSDP2 presets. Every public
name is importable from this package.
"""

from __future__ import annotations

from common.memory_formulas.activations import (
    ATTENTIONS,
    FP32,
    INDEX_BYTES,
    ActivationParts,
    activation_parts,
    checkpointed_blocks,
    kv_heads_per_rank,
    pipeline_activations,
    transformer_activations,
)
from common.memory_formulas.fsdp2 import (
    FSDP2_SHARDED_BYTES,
    Fsdp2Memory,
    Fsdp2Units,
    fsdp2_memory,
    fsdp2_units,
)
from common.memory_formulas.model_facts import (
    ASSUMED_ASPECT,
    ASSUMED_HEAD_DIM,
    ASSUMED_VOCAB,
    LLAMA_LIKE,
    ModelFacts,
    assumed_transformer,
    count_module,
    expert_numel,
    facts_from_hf_config,
    facts_from_model_config,
    facts_from_module,
    lora_params,
    param_numels,
    persistent_params,
    tensor_replicated_numel,
)
from common.memory_formulas.model_states import (
    ADAM_STATE_BYTES,
    DS_ADDITIONAL_BUFFER_FACTOR,
    DS_MAX_LIVE_PARAMETERS,
    OFFLOADS,
    USABLE_FRACTION,
    WORKING_BYTES,
    buffer_bytes,
    deepspeed_estimate,
    guide_model_states,
    place_states,
    predicted_model_state_bytes,
)
from common.memory_formulas.offload import (
    FP32_MASTER_AND_MOMENTS,
    GUIDE_BANDWIDTH_GBPS,
    LINKS,
    MIN_SWAPPED_BYTES,
    NODE_SHARED_LINKS,
    link_seconds,
    link_seconds_range,
    nvme_swapped_bytes_per_rank,
    offload_traffic,
    parse_bandwidths,
    swap_threshold_bytes,
)
from common.memory_formulas.units import (
    GB,
    GIB,
    fmt_gb,
    parse_bytes,
    parse_count,
)

__all__ = [
    "FSDP2_SHARDED_BYTES",
    "Fsdp2Memory",
    "Fsdp2Units",
    "fsdp2_memory",
    "fsdp2_units",
    "ADAM_STATE_BYTES",
    "ASSUMED_ASPECT",
    "ASSUMED_HEAD_DIM",
    "ASSUMED_VOCAB",
    "ATTENTIONS",
    "ActivationParts",
    "DS_ADDITIONAL_BUFFER_FACTOR",
    "DS_MAX_LIVE_PARAMETERS",
    "FP32",
    "FP32_MASTER_AND_MOMENTS",
    "GB",
    "GIB",
    "GUIDE_BANDWIDTH_GBPS",
    "INDEX_BYTES",
    "LINKS",
    "LLAMA_LIKE",
    "MIN_SWAPPED_BYTES",
    "ModelFacts",
    "NODE_SHARED_LINKS",
    "OFFLOADS",
    "USABLE_FRACTION",
    "WORKING_BYTES",
    "activation_parts",
    "assumed_transformer",
    "buffer_bytes",
    "checkpointed_blocks",
    "count_module",
    "deepspeed_estimate",
    "expert_numel",
    "facts_from_hf_config",
    "facts_from_model_config",
    "facts_from_module",
    "fmt_gb",
    "guide_model_states",
    "kv_heads_per_rank",
    "link_seconds",
    "link_seconds_range",
    "lora_params",
    "nvme_swapped_bytes_per_rank",
    "offload_traffic",
    "param_numels",
    "parse_bandwidths",
    "parse_bytes",
    "parse_count",
    "persistent_params",
    "pipeline_activations",
    "place_states",
    "predicted_model_state_bytes",
    "swap_threshold_bytes",
    "tensor_replicated_numel",
    "transformer_activations",
]
