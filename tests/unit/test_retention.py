"""Checkpoint retention (keep_last, keep_every): what stays, what goes, and that a complete checkpoint always stays.

The folders here are real (made in tmp_path) and go through the same publish_checkpoint the recipes call; the
expected listings are written out by hand. The 2-process runs that publish through both backends with retention on
are in tests/recipes/test_resume.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from common.checkpoint import (
    check_retention,
    latest_checkpoint,
    publish_checkpoint,
    retained_steps,
    tmp_checkpoint_dir,
)
from common.errors import ConfigError


def write_tmp(run: Path, step: int, content: str = "") -> None:
    """What every rank leaves before rank 0 publishes: the temporary folder with a shard in it."""
    tmp = tmp_checkpoint_dir(run, step)
    tmp.mkdir(parents=True)
    (tmp / "shard.pt").write_text(content or f"state at step {step}")


def listing(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def save(run: Path, step: int, keep_last: int, keep_every: int = 0) -> None:
    write_tmp(run, step)
    publish_checkpoint(run, step, keep_last, keep_every)


@pytest.mark.parametrize(
    ("steps", "newest", "keep_last", "keep_every", "expected"),
    [
        ([2, 4, 6, 8], 10, 2, 0, {8, 10}),
        ([2, 4, 6, 8], 10, 1, 0, {10}),
        ([2, 4, 6, 8], 10, 2, 4, {4, 8, 10}),
        ([2, 4, 6, 8], 10, 1, 3, {6, 10}),
        ([], 2, 3, 0, {2}),  # the first checkpoint: the only one
        ([2, 4, 12], 6, 2, 0, {4, 6, 12}),  # 12: an earlier attempt's, not this timeline's to delete
        ([2, 4, 6], 6, 1, 0, {6}),  # the same step published again
    ],
)
def test_retained_steps(steps, newest, keep_last, keep_every, expected):
    assert retained_steps(steps, newest, keep_last, keep_every) == expected


def test_keep_last_and_keep_every_over_a_run(tmp_path):
    for step in range(2, 21, 2):
        save(tmp_path, step, keep_last=2, keep_every=8)
        assert latest_checkpoint(tmp_path).name == f"step_{step:06d}"
    assert listing(tmp_path) == ["latest", "step_000008", "step_000016", "step_000018", "step_000020"]
    assert (tmp_path / "checkpoints" / "step_000016" / "shard.pt").read_text() == "state at step 16"


def test_keep_last_1_always_leaves_the_checkpoint_latest_names(tmp_path):
    for step in (5, 10, 15):
        save(tmp_path, step, keep_last=1)
        assert listing(tmp_path) == ["latest", f"step_{step:06d}"]
        assert latest_checkpoint(tmp_path).name == f"step_{step:06d}"


@pytest.mark.parametrize("step", [8, 4])
def test_a_save_that_wrote_nothing_deletes_nothing(tmp_path, step):
    # A rank failed before writing (disk full, killed): rank 0 must not clear the way for a checkpoint that is
    # not there, neither older ones nor (step 4) the published checkpoint of the same step.
    save(tmp_path, 4, keep_last=1)
    with pytest.raises(RuntimeError, match="nothing to publish"):
        publish_checkpoint(tmp_path, step, keep_last=1)
    assert listing(tmp_path) == ["latest", "step_000004"]
    assert latest_checkpoint(tmp_path).name == "step_000004"


def test_the_published_checkpoint_of_a_step_is_not_replaced_by_a_second_save_of_it(tmp_path):
    # Replacing it would leave `latest` naming a folder that is gone until the rename lands.
    save(tmp_path, 4, keep_last=1)
    write_tmp(tmp_path, 4, content="second save")
    publish_checkpoint(tmp_path, 4, keep_last=1)
    assert listing(tmp_path) == ["latest", "step_000004"]
    assert (tmp_path / "checkpoints" / "step_000004" / "shard.pt").read_text() == "state at step 4"


def test_an_earlier_attempts_unpublished_checkpoint_is_replaced_when_the_run_gets_there(tmp_path):
    save(tmp_path, 4, keep_last=2)
    stale = tmp_path / "checkpoints" / "step_000008"  # renamed into place, then a crash before `latest` moved
    stale.mkdir()
    (stale / "shard.pt").write_text("abandoned timeline")
    save(tmp_path, 6, keep_last=1)
    assert listing(tmp_path) == ["latest", "step_000006", "step_000008"]
    save(tmp_path, 8, keep_last=1)
    assert listing(tmp_path) == ["latest", "step_000008"]
    assert (stale / "shard.pt").read_text() == "state at step 8"


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "interval", "message"),
    [
        (0, 0, 4, "keep_last must be >= 1"),
        (2, -1, 4, "keep_every must be >= 0"),
        (2, 10, 4, "use a multiple of 4, e.g. keep_every=12"),
        (2, 2, 4, "e.g. keep_every=4"),
    ],
)
def test_retention_settings_that_would_surprise_are_refused(keep_last, keep_every, interval, message):
    with pytest.raises(ConfigError, match=message):
        check_retention(keep_last, keep_every, interval)


def test_every_recipe_config_checks_its_retention_keys():
    root = Path(__file__).resolve().parents[2] / "recipes"
    for folder, module, cls in (
        ("cv", "cv_config", "CVConfig"),
        ("nlp", "nlp_config", "NLPConfig"),
        ("nlp", "finetune_config", "FinetuneConfig"),
        ("science", "science_config", "ScienceConfig"),
    ):
        sys.path.insert(0, str(root / folder))
        try:
            config = getattr(__import__(module), cls)
        finally:
            sys.path.remove(str(root / folder))
        with pytest.raises(ConfigError, match="keep_last must be >= 1"):
            config(keep_last=0)
        with pytest.raises(ConfigError, match="checkpoint_interval=3"):
            config(checkpoint_interval=3, keep_every=4)


def test_a_publish_deletes_earlier_half_written_folders_but_not_a_later_one_in_flight(tmp_path):
    # With async_save, rank 0 publishes step 4 from its writer thread while another rank may already write step 8.
    for step in (2, 8):
        tmp_checkpoint_dir(tmp_path, step).mkdir(parents=True)
    save(tmp_path, 4, keep_last=2)
    assert listing(tmp_path) == [".tmp-step_000008", "latest", "step_000004"]
