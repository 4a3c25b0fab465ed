"""A results file written on a copy of the tree without its .git (a GPU machine the tree was sent to) names the
commit the sender gives in ``ZR_GIT_COMMIT``, and nothing that is not a full hash."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _bench_util  # noqa: E402


def test_a_copy_without_git_takes_the_senders_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(_bench_util, "REPO", tmp_path)  # a folder that is no git checkout
    monkeypatch.delenv("ZR_GIT_COMMIT", raising=False)
    assert _bench_util.git_commit() == "unknown (not a git checkout)"
    monkeypatch.setenv("ZR_GIT_COMMIT", "a" * 40)
    assert _bench_util.git_commit() == "a" * 40
    monkeypatch.setenv("ZR_GIT_COMMIT", "HEAD-dirty")  # not a hash: refused, as before
    assert _bench_util.git_commit() == "unknown (not a git checkout)"


def test_a_checkout_ignores_the_variable(monkeypatch):
    monkeypatch.setenv("ZR_GIT_COMMIT", "b" * 40)
    assert not _bench_util.git_commit().startswith("b" * 40)
