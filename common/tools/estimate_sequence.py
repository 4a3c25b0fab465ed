"""The longest sequence each row of ``zero-recipes estimate`` fits, with and without sequence parallelism.

A binary search over the planner's own totals (:mod:`common.tools.memory`): model states and buffers do not depend on
the sequence, the activations (:func:`common.memory_formulas.pipeline_activations`) grow with it.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

from common.memory_formulas import USABLE_FRACTION, ModelFacts, pipeline_activations

# A plan, its inputs and its rows are common.tools.memory's Plan, PlanInputs and Row (which imports this module).
Plan = PlanInputs = Row = Any

SEQ_STEP = 1024  # the search's granularity: sequence lengths are multiples of it (and of SP)
MAX_SEQ_LEN = 2**26  # 67M tokens: the search's ceiling


def longest_sequence(facts: ModelFacts, inputs: PlanInputs, base_bytes: float, sequence_parallel: int) -> int | None:
    """The longest sequence, a multiple of lcm(1024, SP) tokens, whose planner total fits in the usable memory.

    ``base_bytes`` is a row's model states + buffers per rank (they do not depend on the sequence); activations are
    :func:`common.memory_formulas.pipeline_activations` with the run's micro batch, precision, attention and
    checkpointing preset (``inputs.activation_checkpointing``), at ``sequence_parallel``. A binary search: the
    activations grow with the sequence. None when not even one step fits, or the activations are not estimated.
    """
    layout = inputs.layout
    step = math.lcm(SEQ_STEP, sequence_parallel)
    usable = USABLE_FRACTION * inputs.device_memory_bytes
    run = (inputs.activation_checkpointing, inputs.precision, inputs.attention, layout.tensor, layout.pipeline)

    def fits(k: int) -> bool:
        act = pipeline_activations(facts, k * step, inputs.micro_batch_size, *run, sequence_parallel)
        return act is not None and base_bytes + act <= usable

    lo, hi = 0, MAX_SEQ_LEN // step  # fits(lo) is assumed, the answer is lo
    if not fits(1):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def longest_summary(result: Plan) -> dict[str, Any]:
    """The ``--json`` form of the longest sequences: the best row with and without SP, on the device alone and with
    offload, for the run's micro batch and checkpointing preset."""
    inp = result.inputs

    def best(rows: list[Row], key: str) -> dict[str, Any] | None:
        found = [r for r in rows if getattr(r, key)]
        if not found:
            return None
        row = max(found, key=lambda r: (getattr(r, key), -r.stage))
        return {"seq_len": getattr(row, key), "stage": row.stage, "offload": row.offload, "preset": row.preset}

    on_device = [r for r in result.rows if r.offload == "none"]
    return {
        "sequence_parallel": inp.sequence_parallel,
        "micro_batch_size": inp.micro_batch_size,
        "activation_checkpointing": inp.activation_checkpointing,
        "step_tokens": math.lcm(SEQ_STEP, inp.sequence_parallel),
        "with_sp": {"on_device": best(on_device, "longest_seq_len"), "any": best(result.rows, "longest_seq_len")},
        "without_sp": {
            "on_device": best(on_device, "longest_seq_len_without_sp"),
            "any": best(result.rows, "longest_seq_len_without_sp"),
        },
    }


def longest_lines(result: Plan) -> list[str]:
    """The longest sequence each row fits, with and without sequence parallelism (the planner's totals; printed with
    ``--sequence-parallel`` N > 1, always in ``--json``)."""
    inp = result.inputs
    if result.model.architecture != "transformer" or not any(r.longest_seq_len for r in result.rows):
        return []
    sp = inp.sequence_parallel
    step = math.lcm(SEQ_STEP, sp)
    lines = [
        f"longest sequence that fits, a multiple of {step:,} tokens (planner totals: states + buffers + activations "
        f"with {inp.activation_checkpointing!r} checkpointing, micro batch {inp.micro_batch_size}):"
    ]
    lines = textwrap.wrap(lines[0], width=118, subsequent_indent="  ")
    for r in result.rows:
        if not (r.longest_seq_len or r.longest_seq_len_without_sp):
            continue
        rung = f"stage {r.stage}" + (f" + {r.offload} offload" if r.offload != "none" else "")
        text = f"  {rung + ':':<28} "
        if sp > 1:
            gain = (
                f" ({r.longest_seq_len / r.longest_seq_len_without_sp:.1f}x)"
                if r.longest_seq_len and r.longest_seq_len_without_sp
                else ""
            )
            without, with_sp = _fmt_tokens(r.longest_seq_len_without_sp), _fmt_tokens(r.longest_seq_len)
            text += f"{without} without SP, {with_sp} with SP {sp}{gain}"
        else:
            text += _fmt_tokens(r.longest_seq_len)
        lines.append(text)
    lines.append(
        "  saved-for-backward bytes only: transient buffers (the logits' gradient, attention workspace) come on top"
    )
    return lines


def _fmt_tokens(n: int | None) -> str:
    """``98,304 tokens``; ``none`` when not one step fits; ``>= ...`` at the search's ceiling."""
    if n is None:
        return "none"
    return f">= {n:,} tokens" if n + SEQ_STEP > MAX_SEQ_LEN else f"{n:,} tokens"
