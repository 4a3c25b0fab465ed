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
import functools
import importlib.util
import json
import re
import subprocess
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
    "allocator_offload.json": "allocator_offload.py",
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
    "communication.json": "communication.py",
    "peer.json": "peer.py",
    "peer_settings.json": "peer.py",
    "peer_125m.json": "peer.py",
    "peer_125m_profile.json": "peer.py",
}
PROVENANCE_KEYS = ("command", "git_commit", "date", "versions", "cpu_count")
MACHINE_KEYS = ("cpu_model", "cpu_count", "memory_bytes", "disks")
# Results files whose rows can come from different runs of their bench (a partial rerun keeps the other rows): the
# key of the row list. Each row carries the provenance of the run that measured it.
ROW_PROVENANCE = {"science_errors.json": "runs"}

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


@functools.cache
def machine_recorded_since() -> str | None:
    """The commit from which bench/_bench_util.provenance records the machine (None outside a git checkout)."""
    log = subprocess.run(
        ["git", "log", "--reverse", "--format=%H", "-S", '"machine": machine_facts(', "--", "bench/_bench_util.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    commits = log.stdout.split() if log.returncode == 0 else []
    return commits[0] if commits else None


def records_the_machine(commit: str) -> bool:
    """Whether code at ``commit`` recorded the machine: a results file written there must name it; one written
    before the provenance did is judged on what it recorded then. Outside a git checkout nothing can be told, and
    the machine is not asked for."""
    since = machine_recorded_since()
    if since is None:
        return False
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", since, commit], cwd=REPO, capture_output=True)
    return ancestor.returncode == 0


def problems_of(prov, bench: str) -> list[str]:
    """What is wrong with one provenance record: a file's, or a row's own."""
    if not isinstance(prov, dict):
        return ["no provenance"]
    problems = [f"provenance lacks {key}" for key in PROVENANCE_KEYS if not prov.get(key)]
    if problems:
        return problems
    if f"bench/{bench}" not in prov["command"]:
        problems.append(f"written by {prov['command']!r}, not bench/{bench}")
    if prov["git_commit"].endswith("-dirty"):
        problems.append(f"measured on an uncommitted tree ({prov['git_commit']}): rerun it from a clean commit")
    elif prov["git_commit"].endswith("-changed-during-run"):
        problems.append(f"the checkout changed while it ran ({prov['git_commit']}): rerun it on a tree left alone")
    elif not re.fullmatch(r"[0-9a-f]{40}", prov["git_commit"]):
        problems.append(f"git_commit {prov['git_commit']!r} is not a commit")
    try:
        datetime.datetime.fromisoformat(prov["date"])
    except (TypeError, ValueError):
        problems.append(f"date {prov['date']!r} is not a timestamp")
    problems += [f"versions lack {pkg}" for pkg in ("torch", "deepspeed") if not prov["versions"].get(pkg)]
    if not isinstance(prov["cpu_count"], int) or prov["cpu_count"] < 1:
        problems.append(f"cpu_count {prov['cpu_count']!r}")
    machine = prov.get("machine")
    if machine is not None or (not problems and records_the_machine(prov["git_commit"])):
        problems += [f"machine lacks {key}" for key in MACHINE_KEYS if not (machine or {}).get(key)]
    return problems


def provenance_problems(document, bench: str, rows_key: str | None = None) -> list[str]:
    """What is wrong with a results document's provenance (empty when its bench wrote it through write_results),
    and with each row's own under ``rows_key``."""
    if not isinstance(document, dict) or set(document) != {"provenance", "results"}:
        return ["not written by write_results (no provenance)"]
    problems = problems_of(document["provenance"], bench)
    for row in document["results"].get(rows_key, []) if rows_key else []:
        problems += [f"row {row.get('name', '?')}: {problem}" for problem in problems_of(row.get("provenance"), bench)]
    return problems


@pytest.mark.parametrize("filename", RESULTS_FILES)
def test_every_results_file_has_provenance_from_its_bench(filename):
    assert filename in RESULTS_BENCH, f"bench/results/{filename}: no bench known to write it; add it to RESULTS_BENCH"
    bench = RESULTS_BENCH[filename]
    try:
        document = json.loads((RESULTS_DIR / filename).read_text())
    except ValueError as err:
        pytest.fail(f"bench/results/{filename} is not JSON ({err}): rerun `python bench/{bench}`")
    problems = provenance_problems(document, bench, ROW_PROVENANCE.get(filename))
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
    commit = written["provenance"]["git_commit"]  # "-dirty" while this checkout has uncommitted changes
    dirty = [f"measured on an uncommitted tree ({commit}): rerun it from a clean commit"] if "-" in commit else []
    assert provenance_problems(json.loads((tmp_path / "x.json").read_text()), "stages.py") == dirty
    wrong_bench = "written by 'python bench/stages.py --reps 1', not bench/gpu.py"
    assert provenance_problems(written, "gpu.py") == [wrong_bench, *dirty]
    machine = written["provenance"]["machine"]
    assert machine["cpu_count"] >= 1 and machine["memory_bytes"] > 0 and machine["cpu_model"]
    assert machine["disks"]["working directory"]["filesystem"]  # the disk a bench writes to by default


def test_the_provenance_check_refuses_a_dirty_commit_and_a_row_without_its_own_run(tmp_path):
    """Per-row provenance: a partial rerun keeps rows of other runs, so each row carries its own, checked alone."""
    sys.path.insert(0, str(REPO / "bench"))
    from _bench_util import provenance

    clean = provenance(["bench/science_errors.py", "--runs", "darcy-bf16"])
    clean["git_commit"] = "0" * 40  # not a descendant of the machine's recording: judged on what it has
    dirty = {**clean, "git_commit": "1" * 40 + "-dirty"}
    rows = [{"name": "darcy-bf16", "provenance": clean}, {"name": "darcy-fp32", "provenance": dirty}]
    rows.append({"name": "darcy-bf16-accelerate", "git_commit": "2" * 40})  # the old shape: a commit, no run
    document = {"provenance": clean, "results": {"runs": rows}}
    assert provenance_problems(document, "science_errors.py") == []  # the file's own provenance alone
    assert provenance_problems(document, "science_errors.py", "runs") == [
        f"row darcy-fp32: measured on an uncommitted tree ({'1' * 40}-dirty): rerun it from a clean commit",
        "row darcy-bf16-accelerate: no provenance",
    ]
    no_machine = {key: value for key, value in clean.items() if key != "machine"}
    since = machine_recorded_since()
    if since is not None:  # written by code that records the machine, without it
        assert problems_of({**no_machine, "git_commit": since}, "science_errors.py") == [
            f"machine lacks {key}" for key in MACHINE_KEYS
        ]
        assert problems_of({**no_machine, "git_commit": "0" * 40}, "science_errors.py") == []  # before it did


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
    rendered = set()
    for filename in RESULTS_FILES:
        bench = RESULTS_BENCH.get(filename)
        assert bench, f"bench/results/{filename}: no bench known to write it"
        rendered |= set(renderer(bench)(json.loads((RESULTS_DIR / filename).read_text())))
    orphans = sorted(marked - rendered)
    assert not orphans, f"docs sections {orphans} are marked as rendered but no bench renders them"


def test_an_unrendered_marked_section_is_found(tmp_path):
    """The check above, on a doc holding a rendered section and one typed between markers."""
    doc = tmp_path / "page.md"
    doc.write_text(
        "<!-- presets:start -->\n## presets\n<!-- presets:end -->\n<!-- typed:start -->\nx\n<!-- typed:end -->"
    )
    marked = set(re.findall(r"<!-- (.+?):start -->", doc.read_text()))
    rendered = set(renderer("stages.py")(json.loads((RESULTS_DIR / "stages.json").read_text())))
    assert "presets" in rendered and sorted(marked - rendered) == ["typed"]


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


def test_a_kept_science_row_takes_the_files_provenance_only_if_that_run_measured_it():
    """A row written before rows carried their own provenance holds only its commit: it is the file's run's row only
    when that run's command named it (or named no rows: the default set) at the same commit."""
    bench = load_bench("science_errors.py")
    file_prov = {
        "command": "python bench/science_errors.py --runs darcy-fp32 burgers-nu0.1-bf16",
        "git_commit": "a" * 40,
    }
    measured = {"name": "darcy-fp32", "git_commit": "a" * 40}
    assert bench.row_provenance(measured, file_prov) is file_prov
    assert bench.row_provenance({"name": "darcy-bf16", "git_commit": "a" * 40}, file_prov) is None  # not in --runs
    assert bench.row_provenance({"name": "darcy-fp32", "git_commit": "b" * 40}, file_prov) is None  # another commit
    default_run = {"command": "python bench/science_errors.py", "git_commit": "a" * 40}
    assert bench.row_provenance({"name": "darcy-bf16", "git_commit": "a" * 40}, default_run) is default_run
    own = {"command": "python bench/science_errors.py --runs darcy-bf16", "git_commit": "c" * 40}
    assert bench.row_provenance({"name": "darcy-bf16", "provenance": own}, file_prov) is own
