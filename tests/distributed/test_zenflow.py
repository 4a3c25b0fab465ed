"""The lint rule ``zenflow`` against DeepSpeed itself: ZenFlow (stall-free ZeRO-Offload) trains on this CPU when the
optimizer comes from DeepSpeed's config, and fails at ``deepspeed.initialize`` with a client optimizer, which is what
the recipes pass (``common.strategy.make_optimizer``). The linter must call an error exactly the run that fails.
"""

from __future__ import annotations

import json
import math

import pytest
from _util import PYTHON, REPO, free_port, run

from common import lint
from common.lint import LintView

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "distributed" / "zenflow_worker.py"
ZENFLOW = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "overlap_comm": True,
        "zenflow": {"topk_ratio": 0.05, "update_interval": 4, "full_warm_up_rounds": 0},
    },
}
CONFIG_OPTIMIZER = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize(
    ("config", "client_optimizer"),
    [({**ZENFLOW, **CONFIG_OPTIMIZER}, False), (ZENFLOW, True)],
    ids=["config_optimizer", "client_optimizer"],
)
def test_the_linter_calls_an_error_exactly_the_zenflow_run_deepspeed_refuses(tmp_path, config, client_optimizer):
    path, out = tmp_path / "ds_config.json", tmp_path / "record.json"
    path.write_text(json.dumps(config))
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port())]
    run([*command, WORKER, "--config", path, "--out", out, *(["--client-optimizer"] if client_optimizer else [])])
    record = json.loads(out.read_text())
    severities = [f.severity for f in lint.offload.rule_zenflow(LintView(ds_config=config))]
    if client_optimizer:
        assert not record["trained"] and "must be a mapping, not NoneType" in record["error"], record
        assert severities == ["error"]
    else:
        assert record["trained"], record
        assert len(record["losses"]) == 6 and all(math.isfinite(loss) for loss in record["losses"]), record
        assert severities == ["info"]
