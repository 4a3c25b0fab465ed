"""The pieces of bench/_bench_util.py that every bench's command line and launch go through."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench._bench_util import (  # noqa: E402
    bench_parser,
    median_and_range,
    publish_document,
    results_json,
    torchrun_command,
    work_folder,
)


def test_a_chosen_work_folder_is_kept_and_a_temporary_one_removed(tmp_path):
    chosen = tmp_path / "runs"
    chosen.mkdir()
    with work_folder(str(chosen), "zr-test-") as work:
        (work / "run.json").write_text("{}")
    assert work == chosen and (chosen / "run.json").exists()  # --work-dir: left for a look
    with work_folder(None, "zr-test-") as work:
        (work / "run.json").write_text("{}")
        assert work.name.startswith("zr-test-")
    assert not work.exists()


def test_torchrun_command_starts_nproc_ranks_on_the_port_given_or_a_free_one():
    assert torchrun_command(4, "29512") == [
        *(sys.executable, "-m", "torch.distributed.run"),
        *("--nproc_per_node", "4", "--master_port", "29512"),
    ]
    port = torchrun_command(2)[-1]
    assert port.isdigit() and 0 < int(port) < 2**16


def test_bench_parser_describes_the_bench_by_its_docstring_and_takes_render():
    parser = bench_parser("What this bench measures.\n\nMore words.")
    assert parser.description == "What this bench measures."
    assert parser.parse_args(["--render"]).render and not parser.parse_args([]).render


def test_publish_document_stamps_each_section_with_the_documents_own_provenance(tmp_path):
    provenance = {"command": "python bench/x.py --reps 3", "date": "2026-01-02T03:04:05+00:00", "cpu_count": 2}
    document = {"provenance": provenance, "results": {"ratio": 1.5}}
    doc = tmp_path / "benchmarks.md"
    publish_document(document, lambda d: {"x ratio": f"ratio {d['results']['ratio']}"}, {"x ratio": doc})
    stamp = "Command: `python bench/x.py --reps 3` (2026-01-02, this machine: 2 CPU cores, shared)."
    assert f"## x ratio\n\n{stamp}\n\nratio 1.5\n" in doc.read_text()


def test_median_and_range_prints_the_median_between_the_extremes_of_the_repetitions():
    assert median_and_range([1.07, 0.98, 1.03]) == "1.03 (0.98-1.07)"
    assert median_and_range([2.0, 1.0, 4.0, 3.0], digits=3) == "2.500 (1.000-4.000)"  # even count: the middle two


def test_a_results_file_reads_back_as_written_with_each_list_of_plain_values_on_one_line():
    document = {
        "provenance": {"command": "python bench/x.py", "versions": {}},
        "results": {
            "steps": [{"calls": [["wait", 0, 0.001], ["all_gather_into_tensor", 4096, 1e-05]], "n": 2}],
            "empty": [],
            "nested": [[1, 2], [3, 4]],
            "none": None,
            "flag": True,
            "text": 'a"b',
        },
    }
    text = results_json(document)
    assert json.loads(text) == document
    calls = '        "calls": [\n          ["wait", 0, 0.001],\n          ["all_gather_into_tensor", 4096, 1e-05]\n'
    assert calls in text
    # Without a list of plain values, the text is json.dumps(indent=2)'s.
    plain = {"a": {"b": 1, "c": {}}, "d": [{"e": "f"}], "g": 1.5, "keys": {3: 0, 2.5: 0, True: 0, None: 0}}
    assert results_json(plain) == json.dumps(plain, indent=2)
