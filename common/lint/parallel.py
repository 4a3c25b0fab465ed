"""Rules on parallel layouts: ZeRO++ (quantized collectives, hierarchical partitioning), pipeline, tensor
and expert parallelism.

Not checked: DeepSpeed's native MoE under ZeRO-3. DeepSpeed refuses it ("Native DeepSpeed MoE is not supported with
ZeRO Stage 3. Use AutoEP or choose ZeRO stage 1/2.", runtime/engine.py _validate_zero3_moe_compatibility), but it
finds native MoE by the model's modules (isinstance deepspeed.moe.layer.MoE), which no config says.
"""

from __future__ import annotations

from common.lint.view import Finding, LintView, Rule, as_number


def rule_zeropp_quantized_needs_gpu(view: LintView) -> list[Finding]:
    """ZeRO++'s qwZ and qgZ run DeepSpeed's CUDA quantizer kernels."""
    quantized = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if view.zero.get(k) is True]
    if not quantized or view.accelerator == "cuda":
        return []
    on_cpu = view.accelerator == "cpu"
    return [
        Finding(
            "zeropp-quantized-needs-gpu",
            "error" if on_cpu else "info",
            f"{' and '.join(quantized)} need DeepSpeed's CUDA quantizer kernels"
            + (": this run has no GPU, and" if on_cpu else ";")
            + " on a CPU the first quantized collective fails ('This op had not been implemented on CPU backend')",
            "on a CPU set them false (hpZ, zero_hpz_partition_size, runs on a CPU: "
            "--set zero_optimization.zero_quantized_weights=false --set zero_optimization.zero_quantized_gradients="
            "false); on GPUs keep them",
        )
    ]


def rule_hpz_partition(view: LintView) -> list[Finding]:
    """ZeRO++'s hpZ: a secondary weight partition over groups of ``zero_hpz_partition_size`` ranks (a node)."""
    hpz = as_number(view.zero.get("zero_hpz_partition_size", 1))
    if hpz is None or hpz <= 1:
        return []
    if view.stage != 3:
        return [
            Finding(
                "hpz-partition",
                "warning",
                f"zero_hpz_partition_size {hpz:g} under ZeRO stage {view.stage}: hpZ partitions stage 3's weights, "
                "other stages ignore it",
                "use stage 3 (preset deepspeed_stage_3_zeropp) or drop the key",
            )
        ]
    world = max(1, view.world_size)
    if world % hpz:
        return [
            Finding(
                "hpz-partition",
                "error",
                f"zero_hpz_partition_size {hpz:g} does not divide the {world} ranks: DeepSpeed cannot form the groups",
                "set it to the devices per node (the factory does: RunFacts(devices_per_node=...))",
            )
        ]
    if hpz >= world:
        return [
            Finding(
                "hpz-partition",
                "warning",
                f"zero_hpz_partition_size {hpz:g} with {world} ranks: the secondary partition spans every rank, so it "
                "duplicates the primary one (16-bit weights / N more memory) and keeps no traffic off the network",
                "on one node leave hpZ off (1); on several, set it to the devices per node",
            )
        ]
    return []


def _tensor_parallel_size(view: LintView) -> float | None:
    """``tensor_parallel.autotp_size`` (AutoTP), else ``tensor.size`` (seen in published
    configs); None when neither is set."""
    ds = view.ds_config or {}
    for section, key in (("tensor_parallel", "autotp_size"), ("tensor", "size")):
        value = ds.get(section)
        if isinstance(value, dict) and as_number(value.get(key)) is not None:
            return as_number(value.get(key))
    return None


def rule_pipeline_zero_stage(view: LintView) -> list[Finding]:
    """DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only.

    ``deepspeed.initialize`` builds ``PipelineEngine`` for any ``deepspeed.pipe.PipelineModule`` (its ``num_stages``
    sets the stages), and that engine is the only reader of a config's ``pipeline`` section (``runtime/config.py``,
    ``get_pipeline_config``): a dict with the section is written for it.
    """
    pipeline = (view.ds_config or {}).get("pipeline")
    if not isinstance(pipeline, dict) or view.stage < 2:
        return []
    stages = as_number(pipeline.get("stages"))
    tp = _tensor_parallel_size(view)
    layout = (f"{stages:g} pipeline stages" if stages else "a pipeline section") + (
        f" and tensor parallelism {tp:g}" if tp and tp > 1 else ""
    )
    # DeepSpeed 0.19.8, runtime/pipe/engine.py, PipelineEngine.__init__:
    #     assert self.zero_optimization_stage() < ZeroStageEnum.gradients, \
    #         "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
    return [
        Finding(
            "pipeline-zero-stage",
            "error",
            f"ZeRO stage {view.stage} with {layout}: DeepSpeed's pipeline engine stops at initialize with 'ZeRO-2 and "
            "ZeRO-3 are incompatible with pipeline parallelism' (a ZeRO-3 + pipeline 4 + tensor 8 layout cannot run)",
            "keep the pipeline with ZeRO-1 (zero_optimization.stage 1: optimizer states sharded over each stage's "
            "data-parallel ranks; tensor parallelism inside a PipelineModule comes from its topology, "
            "PipeModelDataParallelTopology), or drop the pipeline and use ZeRO-3 with tensor parallelism "
            f"(tensor_parallel.autotp_size {f'{tp:g}' if tp and tp > 1 else 'N'}); compare both with zero-recipes "
            "estimate --tensor-parallel/--pipeline-parallel",
        )
    ]


def rule_parallel_keys_ignored(view: LintView) -> list[Finding]:
    """Parallelism keys DeepSpeed does not read: a ``tensor`` section and ``pipeline.stages`` (seen in published
    configs)."""
    ds = view.ds_config or {}
    unread = []
    tensor = ds.get("tensor")
    if tensor is not None:
        size = tensor.get("size") if isinstance(tensor, dict) else None
        said = f"tensor.size {size}" if size is not None else "a 'tensor' section"
        unread.append(f"{said} (not a DeepSpeed key; AutoTP reads tensor_parallel.autotp_size)")
    pipeline = ds.get("pipeline")
    if isinstance(pipeline, dict) and pipeline.get("stages", "auto") != "auto":
        # runtime/config.py keeps "stages" in its defaults, but nothing in DeepSpeed 0.19.8 reads it.
        unread.append("pipeline.stages (the stage count is PipelineModule(num_stages=...) in the training script)")
    if not unread:
        return []
    return [
        Finding(
            "parallel-keys-ignored",
            "warning",
            "DeepSpeed does not read " + " or ".join(unread) + ": the setting is silently ignored",
            "set tensor parallelism as tensor_parallel: {autotp_size: N} and pipeline stages in the PipelineModule; "
            "drop the unread keys",
        )
    ]


def _world_known(view: LintView) -> bool:
    """Whether ``view.world_size`` is a fact: a bare DeepSpeed JSON tells it only through its three batch sizes."""
    if view.source_kind != "deepspeed":
        return True
    ds = view.ds_config or {}
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    return all(isinstance(ds.get(k), int) and not isinstance(ds.get(k), bool) and ds.get(k) > 0 for k in keys)


def rule_autotp_size(view: LintView) -> list[Finding]:
    """``tensor_parallel.autotp_size`` must divide the ranks.

    DeepSpeed 0.19.8 (utils/groups.py, ``_init_tp_mesh_device``) takes ``data_parallel_size = world //
    autotp_size`` and builds a (data parallel, tensor parallel) mesh of that shape: the remainder gets no group.
    """
    section = (view.ds_config or {}).get("tensor_parallel")
    size = as_number(section.get("autotp_size")) if isinstance(section, dict) else None
    world = max(1, view.world_size)
    if size is None or size <= 1 or not _world_known(view) or world % size == 0:
        return []
    return [
        Finding(
            "autotp-size",
            "error",
            f"tensor_parallel.autotp_size {size:g} does not divide the {world} ranks: DeepSpeed builds a "
            f"{world // int(size)} x {size:g} (data x tensor parallel) device mesh, which leaves "
            f"{world % int(size)} rank(s) without a tensor-parallel group",
            f"set autotp_size to a divisor of {world} (at most the devices of a node, where tensor parallelism's "
            "all-reduces are fast), or change the number of ranks",
        )
    ]


RULES: dict[str, Rule] = {
    "zeropp-quantized-needs-gpu": rule_zeropp_quantized_needs_gpu,
    "hpz-partition": rule_hpz_partition,
    "pipeline-zero-stage": rule_pipeline_zero_stage,
    "parallel-keys-ignored": rule_parallel_keys_ignored,
    "autotp-size": rule_autotp_size,
}
