"""The tested version window: read from the package's requirements, checked against what is installed.

``test_the_installed_versions_lie_in_the_declared_window`` is the check CI runs in both of its lanes: the README's
unpinned install (the newest versions the window allows) and the lower-bound lane (``.ci/run``), where
``ZR_LOWER_BOUND_LANE=1`` also demands that every window package sits exactly at its lower bound.
"""

from __future__ import annotations

import os

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from common import version_window as vw
from common.tools.doctor import window_checks
from common.version_window import OutsideWindow

REQUIREMENTS = [
    Requirement(text)
    for text in ("torch>=2.13,<2.15", "deepspeed<0.20,>=0.19.3", "pyyaml>=6.0", "foo<2", "bar==1.0", "Rich_Text>=1,<3")
]


def test_the_window_is_the_requirements_with_two_bounds():
    window = vw.tested_window(REQUIREMENTS)
    assert sorted(window) == ["deepspeed", "rich-text", "torch"]  # names as pip compares them
    assert vw.lower_bounds(window) == {"torch": "2.13", "deepspeed": "0.19.3", "rich-text": "1"}


@pytest.mark.parametrize(
    ("version", "inside"),
    [("2.13.0+cpu", True), ("2.14.1+cu130", True), ("2.13", True), ("2.12.1+cpu", False), ("2.15.0", False)],
)
def test_a_version_is_inside_the_window_with_or_without_a_build_label(version, inside):
    window = vw.tested_window(REQUIREMENTS[:1])
    outside = vw.outside_window({"torch": version}, window)
    assert outside == ([] if inside else [OutsideWindow("torch", version, str(window["torch"]))])


def test_a_missing_package_is_outside():
    assert vw.outside_window({}, vw.tested_window(REQUIREMENTS[:1])) == [OutsideWindow("torch", None, "<2.15,>=2.13")]


def test_doctor_warns_for_each_package_outside_and_says_ok_otherwise():
    outside = [OutsideWindow("deepspeed", "0.20.1", "<0.20,>=0.19.3"), OutsideWindow("peft", None, "<0.22,>=0.18")]
    checks = window_checks(outside)
    assert [(c.check_id, c.severity) for c in checks] == [("tested-window", "warning")] * 2
    assert "deepspeed 0.20.1 is outside the versions this project is tested with (<0.20,>=0.19.3)" in checks[0].message
    assert checks[0].fix.startswith("pip install 'deepspeed<0.20,>=0.19.3'")
    assert checks[1].message == "peft is not installed"
    assert [c.severity for c in window_checks([])] == ["ok"]


def test_the_declared_window_is_read_from_pyproject():
    """In a checkout, pyproject.toml is read (an editable install's metadata may predate an edit of it)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as the reader's own
    dependencies = tomllib.loads(vw.PYPROJECT.read_text())["project"]["dependencies"]
    assert [str(r) for r in vw.declared_requirements()] == [str(Requirement(text)) for text in dependencies]
    window = vw.tested_window(vw.declared_requirements())
    assert {"torch", "deepspeed", "lightning", "accelerate", "transformers", "peft"} <= set(window)


def test_the_installed_versions_lie_in_the_declared_window():
    """The version-window check: what this environment runs is what pyproject.toml says is tested."""
    outside = vw.installed_outside_window()
    assert not outside, f"installed outside the tested window: {outside}"
    if os.environ.get("ZR_LOWER_BOUND_LANE") == "1":
        window = vw.tested_window(vw.declared_requirements())
        not_at_bound = {
            name: vw.installed_version(name)
            for name, lower in vw.lower_bounds(window).items()
            if Version(Version(vw.installed_version(name)).base_version) != Version(lower)
        }
        assert not not_at_bound, f"the lower-bound lane runs above the lower bounds: {not_at_bound}"
