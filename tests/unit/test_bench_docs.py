"""Every published benchmark figure is machine-written: results files carry provenance, docs match their rendering.

Each bench with results follows one contract (bench/_bench_util.py): it writes bench/results/NAME.json only
through ``write_results`` (``{"provenance": ..., "results": ...}``), and a pure ``render_sections(document)``
turns that document into ``{section name: Markdown body}``; the bench writes each body between the markers
``<!-- name:start -->`` and ``<!-- name:end -->`` of a doc, under a "Command: `...` (date, ...)." line taken
from the provenance. These tests re-render every section from the JSON and compare it with the docs, so a
hand-edited table, a hand-written results file or a doc left behind by a rerun fails here.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "bench" / "results"
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]

# Which bench writes which results file. A new results file must be added here (a test fails until it is).
RESULTS_BENCH = {
    "stages.json": "stages.py",
    "gpu_cpu_mode.json": "gpu.py",
    "gpu.json": "gpu.py",
    "export_memory.json": "export_memory.py",
    "overhead.json": "overhead.py",
    "overhead_allocator.json": "overhead.py",
    "memory.json": "memory.py",
    "activations.json": "activations.py",
    "hang_overhead.json": "hang_overhead.py",
    "nvme_io.json": "nvme_io.py",
    "offload_time.json": "offload_time.py",
    "science_errors.json": "science_errors.py",
    "checkpoint.json": "checkpoint.py",
    "checkpoint_bytes.json": "checkpoint_bytes.py",
    "default_runs.json": "default_runs.py",
    "default_runs_cv.json": "default_runs.py",
    "parallelism.json": "parallelism.py",
    "long_context.json": "long_context.py",
}
PROVENANCE_KEYS = ("command", "git_commit", "date", "versions", "cpu_count")

RESULTS_FILES = sorted(p.name for p in RESULTS_DIR.iterdir() if p.is_file())


def load_bench(name: str):
    """bench/NAME as a module (the benches put bench/ and the repository on sys.path themselves)."""
    spec = importlib.util.spec_from_file_location(f"bench_{Path(name).stem}", REPO / "bench" / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def renderer(bench: str):
    render = getattr(load_bench(bench), "render_sections", None)
    assert render is not None, f"bench/{bench} writes results but has no render_sections(document)"
    return render


def find_section(name: str) -> tuple[Path, str]:
    """(doc, text between the markers) of section ``name``: it must be in exactly one doc, once."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    found = [(doc, text) for doc in DOCS for text in [doc.read_text()] if start in text]
    assert len(found) == 1, f"section {name!r} must be in exactly one doc, found in {[d.name for d, _ in found]}"
    doc, text = found[0]
    assert text.count(start) == 1 and text.count(end) == 1, f"{doc.name}: section {name!r} marked more than once"
    return doc, text[text.index(start) + len(start) : text.index(end)]


def parse_section(name: str, block: str) -> dict[str, str]:
    """The parts write_section writes: heading, "Command: `CMD` (DATE, MACHINE).", then the body."""
    pattern = rf"\n## {re.escape(name)}\n\nCommand: `(?P<command>[^`]*)` \((?P<date>[^,]*), (?P<machine>.*?)\)\.\n\n"
    match = re.match(pattern + r"(?P<body>.*)\n", block, re.S)
    assert match, f"section {name!r} is not in write_section's layout (heading, Command line, body)"
    return match.groupdict()


def provenance_problems(document, bench: str) -> list[str]:
    """What is wrong with a results document's provenance (empty when its bench wrote it through write_results)."""
    if not isinstance(document, dict) or set(document) != {"provenance", "results"}:
        return ["not written by write_results (no provenance)"]
    prov = document["provenance"]
    problems = [f"provenance lacks {key}" for key in PROVENANCE_KEYS if not prov.get(key)]
    if problems:
        return problems
    if f"bench/{bench}" not in prov["command"]:
        problems.append(f"written by {prov['command']!r}, not bench/{bench}")
    if not re.fullmatch(r"[0-9a-f]{40}(-dirty)?", prov["git_commit"]):
        problems.append(f"git_commit {prov['git_commit']!r} is not a commit")
    try:
        datetime.datetime.fromisoformat(prov["date"])
    except (TypeError, ValueError):
        problems.append(f"date {prov['date']!r} is not a timestamp")
    problems += [f"versions lack {pkg}" for pkg in ("torch", "deepspeed") if not prov["versions"].get(pkg)]
    if not isinstance(prov["cpu_count"], int) or prov["cpu_count"] < 1:
        problems.append(f"cpu_count {prov['cpu_count']!r}")
    return problems


@pytest.mark.parametrize("filename", RESULTS_FILES)
def test_every_results_file_has_provenance_from_its_bench(filename):
    assert filename in RESULTS_BENCH, f"bench/results/{filename}: no bench known to write it; add it to RESULTS_BENCH"
    bench = RESULTS_BENCH[filename]
    try:
        document = json.loads((RESULTS_DIR / filename).read_text())
    except ValueError as err:
        pytest.fail(f"bench/results/{filename} is not JSON ({err}): rerun `python bench/{bench}`")
    problems = provenance_problems(document, bench)
    assert not problems, f"bench/results/{filename}: {'; '.join(problems)}: rerun `python bench/{bench}`"


def test_the_provenance_check_refuses_a_hand_written_file_and_accepts_write_results(tmp_path):
    """The check above, on a file in the old hand-written shape and on one written by write_results."""
    sys.path.insert(0, str(REPO / "bench"))
    from _bench_util import write_results

    hand_written = {"deepspeed_stage_3": {"raw_ms": 837.0, "lightning_ms": 849.0}}
    assert provenance_problems(hand_written, "overhead.py") == ["not written by write_results (no provenance)"]
    typed_provenance = {"provenance": {"command": "python bench/overhead.py", "date": "yesterday"}, "results": {}}
    assert "provenance lacks git_commit" in provenance_problems(typed_provenance, "overhead.py")
    written = write_results(tmp_path / "x.json", {"x": 1}, argv=["bench/stages.py", "--reps", "1"])
    assert provenance_problems(json.loads((tmp_path / "x.json").read_text()), "stages.py") == []
    assert provenance_problems(written, "gpu.py") == ["written by 'python bench/stages.py --reps 1', not bench/gpu.py"]


@pytest.mark.parametrize("filename", [f for f in RESULTS_FILES if f in RESULTS_BENCH])
def test_docs_sections_equal_their_rendering_from_the_results_file(filename):
    bench = RESULTS_BENCH[filename]
    render = renderer(bench)
    document = json.loads((RESULTS_DIR / filename).read_text())
    rerun = f"rerun `python bench/{bench}` (or `python bench/{bench} --render` if only the rendering changed)"
    if provenance_problems(document, bench):
        pytest.fail(f"bench/results/{filename} has no valid provenance to render from: rerun `python bench/{bench}`")
    sections = render(document)
    assert sections, f"bench/{bench} rendered no section from bench/results/{filename}"
    for name, body in sections.items():
        doc, block = find_section(name)
        shown = parse_section(name, block)
        where = f"docs section {name!r} of {doc.name} is not what bench/{bench} renders from bench/results/{filename}"
        assert shown["command"] == document["provenance"]["command"], f"{where} (Command line): {rerun}"
        assert shown["date"] == document["provenance"]["date"][:10], f"{where} (date): {rerun}"
        assert shown["body"] == body, f"{where}: {rerun}"


def test_every_rendering_bench_has_a_results_file():
    benches = sorted(p.name for p in (REPO / "bench").glob("[!_]*.py"))
    rendering = [b for b in benches if hasattr(load_bench(b), "render_sections")]
    assert "stages.py" in rendering  # the scan itself works
    for bench in rendering:
        files = [f for f, b in RESULTS_BENCH.items() if b == bench and f in RESULTS_FILES]
        assert files, f"bench/{bench} renders docs but bench/results/ holds none of its results files"


def test_every_marked_docs_section_is_rendered_by_a_bench():
    """A section between markers that no bench renders would look machine-written while typed by hand."""
    marked = {name for doc in DOCS for name in re.findall(r"<!-- (.+?):start -->", doc.read_text())}
    rendered, pending = set(), []
    for filename in RESULTS_FILES:
        bench = RESULTS_BENCH.get(filename)
        render = getattr(load_bench(bench), "render_sections", None) if bench else None
        if render is None:
            pending.append(bench)
            continue
        try:
            rendered |= set(render(json.loads((RESULTS_DIR / filename).read_text())))
        except (KeyError, TypeError):
            pending.append(bench)  # results not yet in the shape the bench renders: the test above names it
    orphans = sorted(marked - rendered)
    if orphans and pending:
        pytest.skip(f"sections {orphans} may come from {sorted(set(filter(None, pending)))}, not rendered yet")
    assert not orphans, f"docs sections {orphans} are marked as rendered but no bench renders them"


def test_hang_overhead_prices_the_watchdog_per_step_from_its_own_cpu_time():
    """Each rank's watchdog: CPU per wake-up x wake-ups in one step (one a second), both ranks summed; off is 0."""
    bench = load_bench("hang_overhead.py")
    ranks = [{"hang_watchdog": {"cpu_s": 0.010, "polls": 10.0}}, {"hang_watchdog": {"cpu_s": 0.004, "polls": 4.0}}]
    # 1 ms per wake-up on each rank; a 500 ms step holds half a wake-up: 0.5 ms per rank, 1.0 ms for both.
    assert bench.watchdog_cpu_per_step_ms(ranks, step_wall_ms=500.0) == pytest.approx(1.0)
    assert bench.watchdog_cpu_per_step_ms([{"hang_watchdog": None}] * 2, step_wall_ms=500.0) == 0.0
    results = json.loads((RESULTS_DIR / "hang_overhead.json").read_text())["results"]
    shares = [
        s
        for by_backend in results["runs"].values()
        for cell in by_backend.values()
        for s in bench.watchdog_shares(cell)
    ]
    assert shares and all(0 < share < 0.02 for share in shares)  # the published direct figure: under the 2 % goal
