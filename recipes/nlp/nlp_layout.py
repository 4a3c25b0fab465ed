"""How the NLP recipe's ranks split the run: one ``common.parallel.ParallelLayout``, refused before any work when it
cannot run, resumed across ZeRO partition counts when it can, and the memory each rank should hold under it.

Every entry point builds the layout once in ``main()`` (:func:`run_layout`) and passes it on: the loops read their
replica's batches from it (``layout.data_parallel_rank(rank)``), ``common.parallel.check_mesh`` compares it with
DeepSpeed's groups, and :func:`memory_plan` applies the planner's per-rank arithmetic to it. The layout rules
themselves are the planner's (``zero-recipes estimate`` refuses the same layouts in its own vocabulary); what is here
is this recipe's own: which entry point runs a pipeline, what the pipeline engine cuts, which memory options each
layout takes; and, for ``train_pipeline.py``, what crosses the pipeline engine's stages (micro-batches, evaluation,
logits, the weights of ``final/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from nlp_config import NLPConfig  # next to this script

from common import tiling
from common.config import config_to_dict
from common.describe import persistent_elements
from common.errors import ConfigError
from common.memory_formulas import ModelFacts, tensor_replicated_numel
from common.parallel import (
    ParallelLayout,
    check_layout,
    parallel_model_state_parts,
    rank_params,
    recipe_option,
    shape_facts,
)
from common.resume import ResumePoint, find_resume_point
from common.strategy import precision_of, zero_stage
from nlp.moe import expert_numels

# activation_checkpointing -> PipelineModule's activation_checkpoint_interval (layers per checkpointed run; 0: off)
PIPELINE_CHECKPOINT_INTERVAL = {"none": 0, "full": 1, "every_k": 2}


def run_layout(
    cfg: NLPConfig, world_size: int, config: Any, ds_config: dict[str, Any], pipeline_engine: bool = False
) -> ParallelLayout:
    """How the run's ranks split the model, refused with one ConfigError when it cannot run.

    The layout rules are the planner's (:func:`common.parallel.check_layout`, DeepSpeed's components, this run's
    ZeRO stage) in this recipe's vocabulary; then the recipe's own: which entry point runs a pipeline, what the
    pipeline engine cuts, and the memory options each layout takes.

    Args:
        config: the model's transformers config (``pretraining.model_config``; no weights, no tokenizer needed).
        pipeline_engine: the caller is ``train_pipeline.py``; Lightning and Accelerate drive a plain
            ``DeepSpeedEngine``, which has no pipeline schedule.
    """
    layout = ParallelLayout(
        world_size,
        tensor=cfg.tensor_parallel,
        pipeline=cfg.pipeline_parallel,
        expert=cfg.expert_parallel,
        sequence=cfg.sequence_parallel,
        zero_stage=zero_stage(ds_config),
        pipeline_engine=pipeline_engine,
        components="deepspeed",
    )
    # A local folder trains with its own layers: no expert of it is DeepSpeed's, whatever its config says.
    facts = shape_facts(config, f"model={cfg.model}", experts=cfg.moe)
    if layout.pipeline > 1 and not pipeline_engine:
        raise ConfigError(
            f"pipeline_parallel={layout.pipeline} runs on recipes/nlp/train_pipeline.py (DeepSpeed's pipeline "
            "engine): Lightning and Accelerate cannot drive engine.train_batch(); launch that script instead"
        )
    check_layout(facts, layout, recipe_option, cfg.seq_len, cfg.attention)
    if pipeline_engine:
        check_pipeline_model(cfg, config)
    check_memory_options(cfg, config, layout, pipeline_engine)
    return layout


def check_pipeline_model(cfg: NLPConfig, config: Any) -> None:
    """What ``train_pipeline.py`` cuts into stages: a Llama (embedding, decoder layers, norm, output layer) with an
    untied output layer, checkpointed a whole layer at a time."""
    if getattr(config, "model_type", None) != "llama":
        raise ConfigError(
            f"the pipeline entry point cuts a Llama into layers (embed_tokens, layers, norm, lm_head); the model is "
            f"{getattr(config, 'model_type', None)!r}: use a Llama or train it with train.py / train_accelerate.py"
        )
    if getattr(config, "tie_word_embeddings", False):
        raise ConfigError(
            "the model ties its input embedding to its output layer: the first and last pipeline stages would share "
            "one matrix (TiedLayerSpec), which this recipe does not build; use a model with tie_word_embeddings=false"
        )
    if cfg.activation_checkpointing not in PIPELINE_CHECKPOINT_INTERVAL:
        raise ConfigError(
            f"activation_checkpointing={cfg.activation_checkpointing} is not available on the pipeline engine (it "
            f"checkpoints whole layers); use one of {', '.join(PIPELINE_CHECKPOINT_INTERVAL)}"
        )


def check_memory_options(cfg: NLPConfig, config: Any, layout: ParallelLayout, pipeline_engine: bool) -> None:
    """Refuse a tiled MLP or loss, or a checkpoint offload, the layout cannot use (common/tiling.py,
    common/activation.py)."""
    names = "tiled_mlp_shards / tiled_loss_shards / offload_checkpoints"
    if pipeline_engine and (cfg.tiled or cfg.offload_checkpoints):
        raise ConfigError(
            f"{names} with the pipeline engine are not supported here (the pipeline's stages run and checkpoint the "
            "layers themselves); use them on train.py or train_accelerate.py"
        )
    if cfg.moe and (cfg.tiled or cfg.offload_checkpoints):
        raise ConfigError(
            f"{names} with the MoE model {cfg.model!r} are not supported here (DeepSpeed's MoE layer routes whole "
            "sequences); leave them off"
        )
    if layout.tensor > 1 and cfg.tiled:
        raise ConfigError(
            f"tiled_mlp_shards / tiled_loss_shards with tensor_parallel={layout.tensor} are not supported here "
            "(AutoTP replaces the layers they slice; untested together); use sequence_parallel for long sequences"
        )
    if cfg.offload_checkpoints and cfg.activation_checkpointing != "full":
        raise ConfigError(
            f"offload_checkpoints moves the inputs of checkpointed layers to host memory; with "
            f"activation_checkpointing={cfg.activation_checkpointing} it needs activation_checkpointing=full"
        )
    tiling.check_tiling(cfg.tiled_mlp_shards, cfg.tiled_loss_shards, getattr(config, "tie_word_embeddings", False))


def resume_point(cfg: NLPConfig, layout: ParallelLayout, pipeline_engine: bool = False) -> ResumePoint | None:
    """``resume=true``: the checkpoint to load (None for a new run), refused with a ConfigError when it cannot be.

    A different model or config (``tensor_parallel`` too) or no complete checkpoint is refused; another ZeRO
    partition count (``layout.zero_ranks``: data parallel x sequence parallel) goes through a universal checkpoint,
    except for the layouts whose conversion is not supported or not tested here.
    """
    if not cfg.resume:
        return None
    resume = find_resume_point(Path(cfg.out_dir), config_to_dict(cfg), layout.zero_ranks)
    unconverted = [
        (pipeline_engine, "pipeline checkpoints is not supported"),
        (layout.sequence > 1, "a sequence-parallel run is not tested"),
        (layout.tensor > 1, "tensor-parallel shards is not supported"),
        (cfg.moe, "DeepSpeed's expert files is not supported"),
    ]
    for refused, why in unconverted:
        if resume.universal and refused:
            raise ConfigError(
                f"resume needs the ZeRO partition count the checkpoint was written with ({resume.saved_world_size} "
                f"rank(s), now {layout.zero_ranks}): a universal conversion of {why} here; launch as many ranks"
            )
    return resume


def tokens_per_rank_step(cfg: NLPConfig, layout: ParallelLayout) -> float:
    """Tokens one rank trains on per optimizer step: the ranks of a replica (tensor, pipeline, sequence parallel)
    share its tokens."""
    return cfg.micro_batch_size * cfg.grad_accum * cfg.seq_len / layout.ranks_per_replica


# --- memory plan ---------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    """What each rank should hold by the planner's formulas (the ZeRO paper's, on the rank's slice of the layout), with
    stage-3 persistent parameters kept whole."""

    num_params: int  # the whole model's (every expert counted)
    persistent_params: int  # elements under stage3_param_persistence_threshold: whole on every rank
    stage: int
    precision: str
    world_size: int
    predicted_bytes_per_rank: dict[str, int]  # params, grads, optimizer, model_states after a step
    grads_during_backward_bytes: int
    params_per_rank: int  # what the layout leaves this rank before ZeRO shards it (dense + its experts)
    layout: str  # ParallelLayout.text(): how the ranks split the model and over how many ZeRO shards

    def text(self) -> str:
        """The lines printed before training."""
        p, mb = self.predicted_bytes_per_rank, 1e6
        split = f"\n  layout: {self.layout}; each rank holds {self.params_per_rank / 1e6:.2f}M parameters before ZeRO"
        return (
            f"memory plan: ZeRO-{self.stage} {self.precision}, {self.world_size} rank(s), "
            f"{self.num_params / 1e6:.2f}M parameters ({self.persistent_params / 1e6:.2f}M under the "
            f"persistence threshold stay whole on every rank)\n"
            f"  each rank holds (predicted, after a step): params {p['params'] / mb:.1f} MB + optimizer "
            f"{p['optimizer'] / mb:.1f} MB (fp32 master + Adam m, v) = {p['model_states'] / mb:.1f} MB of model "
            f"states; gradients add {self.grads_during_backward_bytes / mb:.1f} MB during backward; activations "
            "and ZeRO buffers come on top" + (split if self.params_per_rank != self.num_params else "")
        )


def built_model_facts(model: torch.nn.Module, layout: ParallelLayout) -> ModelFacts:
    """The planner's facts counted on the model as built on this rank (before AutoTP shards it): whole sizes under
    ZeRO-3 (``ds_numel``), and a MoE model's experts as this rank's times the expert-parallel degree."""
    sizes = tuple(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    experts = expert_numels(model)[1] * layout.expert
    return ModelFacts(
        num_params=sum(sizes) - expert_numels(model)[1] + experts,
        param_numels=sizes,
        expert_params=experts,
        tensor_replicated_params=tensor_replicated_numel(model),
        source="the built model",
    )


def memory_plan(model: torch.nn.Module, ds_config: dict[str, Any], layout: ParallelLayout) -> MemoryPlan:
    """The plan for ``model`` under ``ds_config`` and ``layout``: :func:`common.parallel.parallel_model_state_parts`,
    the planner's per-rank arithmetic, on facts counted from the built model."""
    facts = built_model_facts(model, layout)
    stage, precision = zero_stage(ds_config), precision_of(ds_config)
    # FSDP2 (no zero_optimization section) keeps no parameter whole: every one is sharded, as with threshold 0.
    zero = ds_config.get("zero_optimization", {})
    threshold = int(zero.get("stage3_param_persistence_threshold", 0)) if stage == 3 else 0
    parts = {}
    for grads_alive in (False, True):
        terms, whole = parallel_model_state_parts(facts, stage, layout, precision, threshold, grads_alive)
        parts[grads_alive] = {**terms, "params": terms["params"] + whole, "model_states": terms["model_states"] + whole}
    return MemoryPlan(
        num_params=facts.num_params,
        persistent_params=persistent_elements(facts.param_numels, ds_config),
        stage=stage,
        precision=precision,
        world_size=layout.world_size,
        predicted_bytes_per_rank={k: int(v) for k, v in parts[False].items()},
        grads_during_backward_bytes=int(parts[True]["grads"]),
        params_per_rank=int(sum(rank_params(facts, layout))),
        layout=layout.text(),
    )


def measured_text(measured: dict[str, int]) -> str:
    """The line printed after the first step: what the DeepSpeed engine really holds on rank 0."""
    mb = 1e6
    return (
        f"memory measured on rank 0 after its first step: params {measured['params'] / mb:.1f} MB, optimizer "
        f"{measured['optimizer'] / mb:.1f} MB, grads {measured['grads'] / mb:.1f} MB = model states "
        f"{measured['model_states'] / mb:.1f} MB; ZeRO buffers {measured['buffers'] / mb:.1f} MB"
    )


# --- across the pipeline engine's stages (train_pipeline.py) --------------------------------------


def micro_batches(batches: Any) -> Any:
    """(inputs, labels) pairs, the form the engine reads: the first stage takes inputs, the last labels."""
    for batch in batches:
        if isinstance(batch, dict):
            yield batch["input_ids"], batch["labels"]
        else:  # a validation block [b, seq_len + 1]
            yield batch[:, :-1], batch[:, 1:]


def evaluate_pipeline(engine: Any, batches: list[torch.Tensor], micro_batch_size: int) -> float:
    """Mean validation loss over every replica's full micro-batches (the engine's buffers have one shape: a shorter
    last micro-batch is left out), computed on the last stage and broadcast to every stage."""
    full = [b for b in batches if b.shape[0] == micro_batch_size]
    loss = engine.eval_batch(iter(micro_batches(full)), num_micro_batches=len(full))
    return float(loss)


def gather_pipeline_state_dict(engine: Any, rank: int) -> dict[str, torch.Tensor] | None:
    """Whole weights on rank 0 under their Hugging Face names, one stage's layers from each stage (every rank calls
    it; replica 0's ranks send). None on the other ranks."""
    mine: dict[str, torch.Tensor] = {}
    if engine.grid.get_data_parallel_rank() == 0:
        for layer in engine.module.forward_funcs:
            if hasattr(layer, "hf_state_dict"):
                mine |= {k: v.detach().to("cpu", copy=True) for k, v in layer.hf_state_dict().items()}
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if rank == 0 else None


def pipeline_logits(engine: Any, fixed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The trained pipeline's logits on ``fixed`` (one micro-batch), sent from replica 0's last stage to every rank."""
    _, logits = engine.eval_batch(iter(micro_batches([fixed])), return_logits=True, num_micro_batches=1)
    src = engine.grid.stage_to_global(engine.num_stages - 1, data=0)
    mine = list(logits.shape) if engine.global_rank == src else [0, 0, 0]
    shape = torch.tensor(mine, dtype=torch.long, device=device)
    dist.broadcast(shape, src)
    out = logits.float().contiguous() if engine.global_rank == src else torch.empty(*shape.tolist(), device=device)
    dist.broadcast(out, src)
    return out.cpu()
