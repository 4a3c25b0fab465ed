"""DeepSpeed #8148 (0.19.3+): frozen parameters must be partitioned again after activation-checkpoint recomputation.

#8148 taught ZeRO-3 to gather frozen parameters when a checkpointed block is recomputed in backward; its review
found cases where a recomputed frozen parameter stays gathered past its last use. For LoRA on a frozen base that
would keep the whole base on every rank and silently undo ZeRO-3. ``frozen_partition_worker.py`` runs the
fine-tuning situation on DeepSpeed's own engine, 2 processes (gloo): a Llama with LoRA r 4 on every projection,
the ``full`` checkpointing preset, the ``finetune`` preset with ``stage3_param_persistence_threshold`` 0 (below the
threshold a parameter stays resident by design, so 0 makes every frozen parameter one that must be released).
Checked after ``backward`` and after ``step``, on both ranks and for both checkpoint forms (reentrant, the
recipes' form, and non-reentrant): every frozen parameter is ``NOT_AVAILABLE`` and holds no elements. The
fine-tuning run's bytes against ``zero-recipes estimate --lora-rank`` are checked in
``tests/recipes/test_finetune_recipe.py`` (the same ZeRO-3 + full checkpointing + LoRA run).
"""

from __future__ import annotations

import json

import pytest
from _util import PYTHON, REPO, free_port, run

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "distributed" / "frozen_partition_worker.py"
MODES = ("reentrant", "non_reentrant")
# 2 layers x (q, k, v, o, gate, up, down + 2 norms) + embeddings, lm_head and the final norm.
FROZEN_TENSORS = 2 * 9 + 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("frozen_partition")
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    run([*command, WORKER, "--out", out], timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def still_gathered(statuses: dict[str, dict]) -> list[str]:
    """Frozen parameters that hold more than their (empty) placeholder: not released by ZeRO-3."""
    return [
        f"{name} ({s['ds_status']}, {s['local_numel']} of {s['ds_numel']} elements)"
        for name, s in statuses.items()
        if s["frozen"] and (s["ds_status"] != "NOT_AVAILABLE" or s["local_numel"] != 0)
    ]


@pytest.mark.parametrize("mode", MODES)
def test_frozen_base_is_partitioned_again_after_a_recomputed_backward_and_a_step(ranks, mode):
    for record in ranks:
        facts = record[mode]
        assert (
            facts["zero_stage"] == 3
            and record["config"]["zero_optimization"]["stage3_param_persistence_threshold"] == 0
        )
        assert facts["checkpointed_blocks"] == 2  # both decoder layers were recomputed in backward
        for when in ("after_backward", "after_step"):
            frozen = [s for s in facts[when].values() if s["frozen"]]
            assert len(frozen) == FROZEN_TENSORS and not any(s["persist"] for s in frozen)
            gathered = still_gathered(facts[when])
            assert not gathered, f"DeepSpeed {record['deepspeed']}, rank {record['rank']}, {when}: {gathered}"
