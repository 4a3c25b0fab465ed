"""Rewrite the golden DeepSpeed configs in this folder from the strategy factory, for review.

    python tests/golden/regenerate.py          # then read `git diff tests/golden` before committing

tests/unit/test_strategy.py only compares the factory's output with these files; it never writes them. A change
to a preset or to the factory shows up there as a failing test, and here as a diff a person reads and commits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from common.presets import PRESETS  # noqa: E402
from common.strategy import RunFacts, resolve_deepspeed_config  # noqa: E402

GOLDEN = Path(__file__).resolve().parent
# The fixed run facts every golden file is resolved with: 2 nodes of 4 devices (ZeRO++'s hpZ partition is a node), and
# an NVMe folder of the machine the config is for, not of this one (so it is not checked here).
FACTS = RunFacts(
    world_size=8,
    micro_batch_size=4,
    grad_accum=2,
    hidden_size=1024,
    nvme_path="/local_nvme",
    devices_per_node=4,
    check_storage=False,
)


def golden_text(name: str) -> str:
    """The file content for preset ``name``: the resolved config as indented JSON."""
    return json.dumps(resolve_deepspeed_config(name, FACTS), indent=2) + "\n"


def main() -> None:
    for name in PRESETS:
        path = GOLDEN / f"{name}.json"
        text = golden_text(name)
        changed = not path.is_file() or path.read_text() != text
        path.write_text(text)
        print(f"{'changed' if changed else 'same   '} {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
