"""A results file written on a copy of the tree without its .git (a GPU machine the tree was sent to) names the
commit the sender gives in ``ZR_GIT_COMMIT``, and nothing that is not a full hash; a results file names the commit
its bench started from, and says so when the checkout moved on before it was written."""

import subprocess
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


def test_the_commit_is_the_one_the_bench_started_from(tmp_path, monkeypatch):
    """A long bench writes its results minutes after it started: code changed meanwhile is not what it measured, and
    the results say so; a commit of docs alone changes nothing it measured. On a checkout made here."""

    def git(*args: str) -> str:
        command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    (tmp_path / "docs").mkdir()
    (tmp_path / "train.py").write_text("steps = 1\n")
    (tmp_path / "docs" / "results.md").write_text("before\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "measured")
    monkeypatch.setattr(_bench_util, "REPO", tmp_path)
    started = _bench_util.git_commit()
    monkeypatch.setattr(_bench_util, "COMMIT_AT_START", started)
    (tmp_path / "docs" / "results.md").write_text("after\n")
    git("commit", "-qam", "docs only")
    assert _bench_util.provenance(["bench/x.py"])["git_commit"] == started  # HEAD moved, the code did not
    (tmp_path / "train.py").write_text("steps = 2\n")
    assert _bench_util.provenance(["bench/x.py"])["git_commit"] == started + "-changed-during-run"
    git("commit", "-qam", "code")
    assert _bench_util.provenance(["bench/x.py"])["git_commit"] == started + "-changed-during-run"
