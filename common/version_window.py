"""The versions this project is tested with, read from one place: the package's own requirements.

A requirement with both a lower and an upper bound (``deepspeed>=0.19.3,<0.20``) is part of the *tested window*:
CI runs the whole suite at the newest versions the window allows (the README's install) and a compatibility subset
at its lower bounds (``.ci/run``, ``python -m common.version_window --lower-bounds``). A requirement with a lower
bound only (``pyyaml>=6.0``) is a floor the package needs, not a tested range.

The requirements come from ``pyproject.toml`` when it lies beside the imported package (a source checkout, installed
editable or not), else from the installed distribution's metadata (what ``pip install`` recorded from that same
file): one text either way, never a second copy. ``zero-recipes doctor`` warns for an installed version outside the
window.

    python -m common.version_window --lower-bounds     # "name==lower" per window package: a pip constraints file
    python -m common.version_window --check            # exit 1 naming each installed version outside the window
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "zero-recipes"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@dataclass(frozen=True)
class OutsideWindow:
    """An installed package whose version the window does not contain (``version`` None: not installed)."""

    package: str
    version: str | None
    specifier: str


def _pyproject_dependencies(path: Path) -> list[str]:
    """``[project].dependencies`` of a pyproject.toml (tomllib; Python 3.10 has none, then nothing is read)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: an installed package has its metadata, which is what is read first
        return []
    try:
        return list(tomllib.loads(path.read_text())["project"]["dependencies"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return []


def declared_requirements(pyproject: Path = PYPROJECT) -> list[Requirement]:
    """The package's runtime requirements (no extras): ``pyproject.toml`` beside the package, else its metadata.

    The file comes first because an editable install records the metadata once, at install time: a checkout edited
    since then says what its own tests are run with.
    """
    texts: list[str] = []
    if pyproject.is_file():
        texts = _pyproject_dependencies(pyproject)
    if not texts:
        try:
            texts = metadata.requires(DISTRIBUTION) or []
        except metadata.PackageNotFoundError:
            texts = []
    requirements = []
    for text in texts:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            requirements.append(requirement)
    return requirements


def _bounds(specifier: SpecifierSet) -> tuple[str | None, str | None]:
    """The ``>=`` version and the ``<`` version of a specifier (None where absent)."""
    lower = next((s.version for s in specifier if s.operator == ">="), None)
    upper = next((s.version for s in specifier if s.operator == "<"), None)
    return lower, upper


def tested_window(requirements: list[Requirement]) -> dict[str, SpecifierSet]:
    """Package -> specifier, for the requirements with both a lower (``>=``) and an upper (``<``) bound."""
    return {
        canonicalize_name(r.name): r.specifier for r in requirements if all(bound for bound in _bounds(r.specifier))
    }


def lower_bounds(window: dict[str, SpecifierSet]) -> dict[str, str]:
    """Package -> the window's lower bound: what the lower-bound lane of CI installs, exactly."""
    return {name: str(_bounds(specifier)[0]) for name, specifier in window.items()}


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (package metadata, no import), or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def outside_window(installed: dict[str, str | None], window: dict[str, SpecifierSet]) -> list[OutsideWindow]:
    """The window packages whose installed version (``installed``: package -> version or None) it does not contain.

    A local build label (``2.13.0+cpu``) is part of the version it labels: it is inside whenever ``2.13.0`` is.
    """
    found = []
    for package, specifier in window.items():
        version = installed.get(package)
        try:
            inside = version is not None and specifier.contains(Version(version), prereleases=True)
        except InvalidVersion:
            inside = False
        if not inside:
            found.append(OutsideWindow(package, version, str(specifier)))
    return found


def installed_outside_window(window: dict[str, SpecifierSet] | None = None) -> list[OutsideWindow]:
    """:func:`outside_window` for this environment and the declared window."""
    window = tested_window(declared_requirements()) if window is None else window
    return outside_window({package: installed_version(package) for package in window}, window)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.version_window", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--lower-bounds", action="store_true", help="print name==lower per window package")
    mode.add_argument("--check", action="store_true", help="exit 1 if an installed version is outside the window")
    args = parser.parse_args(argv)
    window = tested_window(declared_requirements())
    if not window:
        print(f"error: no tested window found (neither {PYPROJECT} nor {DISTRIBUTION}'s metadata)", file=sys.stderr)
        return 2
    if args.lower_bounds:
        print("\n".join(f"{name}=={version}" for name, version in lower_bounds(window).items()))
        return 0
    outside = installed_outside_window(window)
    for item in outside:
        print(f"error: {item.package} {item.version or 'not installed'} is outside {item.specifier}", file=sys.stderr)
    if not outside:
        shown = ", ".join(f"{p} {installed_version(p)}" for p in window)
        print(f"inside the tested window: {shown}")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
