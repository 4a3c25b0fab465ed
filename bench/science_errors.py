"""The science recipe's figures against the FNO paper's: each shipped config run as a user runs it.

    flock /tmp/zr-heavy.lock python bench/science_errors.py          # every CPU row: ~35 min on 2 cores
    python bench/science_errors.py --runs darcy-bf16 darcy-fp32       # some rows (the others are kept)
    python bench/science_errors.py --render   # rewrite docs/science.md from the results file, measuring nothing

1. Each row is one recipe run, launched exactly as the command in its ``command`` column (Lightning's
   ``train.py``, or ``accelerate launch`` with the shipped ``accelerate.yaml``), into a temporary run directory;
   its ``summary.json`` gives the relative L2 test error, the precision, the ZeRO stage and the wall time.
2. The solvers' own error (``refinement_error``): the first test samples solved as the dataset solves them, and
   again at twice the resolution (Burgers: and half the time step), compared on the dataset's points.
3. Writes bench/results/science_errors.json (write_results: provenance included) and renders from that file alone the
   sections "science problems" and "science solvers" of docs/science.md.

The paper-sized configs (``*_paper.yaml``, 25,000 steps) are GPU runs: their commands are in the YAML files; a
row for them is added by ``--runs`` with their names once a machine can run them (``--list`` shows the names).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed

from bench._bench_util import (  # noqa: E402
    REPO,
    add_results_options,
    bench_env,
    bench_parser,
    free_port,
    load_document,
    provenance,
    render_from_file,
    save_and_publish,
)
from common.errors import exit_on_user_error  # noqa: E402

RESULTS = HERE / "results" / "science_errors.json"
SCIENCE_DOC = REPO / "docs" / "science.md"
DOCS = {"science problems": SCIENCE_DOC, "science solvers": SCIENCE_DOC}
CONFIGS = "recipes/science/configs"
# The paper's relative L2 test errors (Li et al. 2021, Table 1 for Burgers at s = 1024 and viscosity 1e-3,
# Table 4 for Darcy at s = 85; section 5.1's text for Burgers at viscosity 0.1 on 256 points).
PAPER = {"burgers_nu1e-3": 0.0160, "darcy": 0.0108, "burgers_nu0.1": 0.0018}
# The bars for the 5-minute CPU configs (the paper-sized configs' bar is the paper's figure).
CPU_BARS = {"darcy": 0.03}
# name -> (problem, config file, backend, extra overrides)
RUNS: dict[str, tuple[str, str, str, list[str]]] = {
    "darcy-bf16": ("darcy", "darcy.yaml", "lightning", []),
    "darcy-fp32": ("darcy", "darcy.yaml", "lightning", ["precision=fp32"]),
    "darcy-bf16-accelerate": ("darcy", "darcy.yaml", "accelerate", []),
    "burgers-nu1e-3-bf16": ("burgers_nu1e-3", "burgers_nu1e-3.yaml", "lightning", []),
    "burgers-nu1e-3-fp32": ("burgers_nu1e-3", "burgers_nu1e-3.yaml", "lightning", ["precision=fp32"]),
    "burgers-nu0.1-bf16": ("burgers_nu0.1", "tiny_cpu.yaml", "lightning", []),
    "burgers-nu0.1-bf16-accelerate": ("burgers_nu0.1", "tiny_cpu.yaml", "accelerate", []),
    # Not in the default set (--runs NAME): the viscosity-0.1 paper config on CPU (5,000 steps, ~6 min each) ...
    "burgers-nu0.1-paper-bf16": ("burgers_nu0.1", "paper.yaml", "lightning", []),
    "burgers-nu0.1-paper-fp32": ("burgers_nu0.1", "paper.yaml", "lightning", ["precision=fp32"]),
    "burgers-nu0.1-paper-bf16-head": ("burgers_nu0.1", "paper.yaml", "lightning", ["fp32_head=false"]),
    # ... and the paper-sized configs of the two hard problems, GPU runs on one device.
    "darcy-paper-bf16": ("darcy", "darcy_paper.yaml", "lightning", ["devices=1"]),
    "darcy-paper-fp32": ("darcy", "darcy_paper.yaml", "lightning", ["devices=1", "precision=fp32"]),
    "burgers-nu1e-3-paper-bf16": ("burgers_nu1e-3", "burgers_nu1e-3_paper.yaml", "lightning", ["devices=1"]),
    "burgers-nu1e-3-paper-fp32": (
        "burgers_nu1e-3",
        "burgers_nu1e-3_paper.yaml",
        "lightning",
        ["devices=1", "precision=fp32"],
    ),
}
CPU_RUNS = [name for name in RUNS if "paper" not in name]
SUMMARY_FIELDS = ("val_rel_l2", "precision", "zero_stage", "backend", "world_size", "steps", "wall_time_s", "preset")


def user_command(name: str) -> str:
    """The command a user types for this row (what the docs table shows)."""
    _, config, backend, extra = RUNS[name]
    args = " ".join(["--config", f"{CONFIGS}/{config}", *extra])
    if backend == "accelerate":
        launch = "accelerate launch --config_file recipes/science/accelerate.yaml recipes/science/train_accelerate.py"
        return f"{launch} {args}"
    return f"python recipes/science/train.py {args}"


def run_recipe(name: str, out_dir: Path) -> dict:
    """One row: the recipe launched as ``user_command(name)`` says, into ``out_dir``; its summary and times."""
    _, config, backend, extra = RUNS[name]
    script_args = ["--config", str(REPO / CONFIGS / config), *extra, f"out_dir={out_dir}"]
    if backend == "accelerate":
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
        launcher += [str(REPO / "recipes/science/accelerate.yaml"), "--main_process_port", str(free_port())]
        cmd = [*launcher, str(REPO / "recipes/science/train_accelerate.py"), *script_args]
    else:
        cmd = [sys.executable, str(REPO / "recipes/science/train.py"), *script_args]
    env = {key: value for key, value in bench_env().items() if key not in ("MASTER_PORT", "MASTER_ADDR")}
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=7200)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    row = {key: summary[key] for key in SUMMARY_FIELDS}
    problem = RUNS[name][0]
    row.update(
        name=name,
        problem=problem,
        config=RUNS[name][1],
        command=user_command(name),
        launch_seconds=round(elapsed, 1),  # the whole command, data cache read and launcher included
        grid_size=summary["grid_size"],
        n_train=summary["n_train"],
        n_test=summary["n_test"],
        data_generation_seconds=summary["data_meta"].get("generation_seconds"),
        paper_rel_l2=PAPER[problem],
        provenance=provenance(),  # per row: a partial rerun keeps the other rows with the run that measured them
    )
    print(f"[{name}] relative L2 {row['val_rel_l2']:.4f} in {elapsed:.0f} s", flush=True)
    return row


def measured_runs(command: str) -> list[str]:
    """The rows a command of this bench measured: its ``--runs`` names, else the default CPU rows."""
    args = shlex.split(command)
    if "--runs" not in args:
        return list(CPU_RUNS)
    names = args[args.index("--runs") + 1 :]
    return names[: next((i for i, arg in enumerate(names) if arg.startswith("-")), len(names))]


def row_provenance(row: dict, file_provenance: dict) -> dict | None:
    """A kept row's own provenance. Rows written before rows carried one hold only their ``git_commit``: the
    file's provenance is theirs when that run measured them (their name in its ``--runs``, the same commit);
    otherwise nothing is known of their run, and the provenance check asks for a rerun."""
    if "provenance" in row:
        return row["provenance"]
    if row.get("git_commit") == file_provenance["git_commit"] and row["name"] in measured_runs(
        file_provenance["command"]
    ):
        return file_provenance
    return None


def solver_errors(samples: int) -> dict:
    """Each generator's own error against twice its resolution (Burgers: and half its time step)."""
    from science import burgers, darcy

    fields = {key: value for key, value in burgers.PUBLIC_GENERATOR.items() if key != "viscosity"}
    return {
        "burgers_nu1e-3": burgers.refinement_error(samples, burgers.PUBLIC_GENERATOR["viscosity"], 1024, **fields),
        "darcy": darcy.refinement_error(samples, grid_size=85, solve_grid=421),
    }


# --- rendering --------------------------------------------------------------------------------------------

PROBLEM_LABELS = {
    "darcy": "Darcy 2-D, s = 85",
    "burgers_nu1e-3": "Burgers, viscosity 1e-3, s = 1024",
    "burgers_nu0.1": "Burgers, viscosity 0.1, s = 256",
}


def runs_by_provenance(rows: list[dict]) -> dict[tuple[str, str, str], list[str]]:
    """(bench command, commit, day) -> the rows that run measured, in the table's order."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for row in rows:
        prov = row.get("provenance") or {"command": "unknown", "git_commit": "unknown", "date": "unknown"}
        groups.setdefault((prov["command"], prov["git_commit"], prov["date"][:10]), []).append(row["name"])
    return groups


def problems_body(results: dict) -> str:
    lines = [
        "| problem | config | precision | ZeRO stage | backend | our rel. L2 | paper's rel. L2 | bar | "
        "steps | wall time | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["runs"]:
        precision = row["precision"]
        if precision == "bf16":  # what bf16 covers: the fp32 head (the default) keeps the prediction in fp32
            precision = "bf16 everywhere" if "fp32_head=false" in row["command"] else "bf16 (fp32 head)"
        bar = row["paper_rel_l2"] if row["config"].endswith("_paper.yaml") else CPU_BARS.get(row["problem"])
        verdict = f"<= {bar} {'met' if row['val_rel_l2'] <= bar else 'NOT met'}" if bar else "-"
        lines.append(
            f"| {PROBLEM_LABELS[row['problem']]} | `{row['config']}` | {precision} | {row['zero_stage']} "
            f"| {row['backend']} | **{row['val_rel_l2']:.4f}** | {row['paper_rel_l2']} | {verdict} | {row['steps']} "
            f"| {row['wall_time_s']:.0f} s | `{row['command']}` |"
        )
    lines += ["", "Each row's own run of this bench (a partial rerun with `--runs` keeps the other rows):", ""]
    for (command, commit, date), names in runs_by_provenance(results["runs"]).items():
        lines.append(f"- `{command}` at commit `{commit[:10]}` ({date}): {', '.join(names)}")
    lines.append("")
    lines.append(
        "Wall time: rank 0's `wall_time_s` from `summary.json` (start of `main()` to the summary, data cache read "
        f"included), on {results['world_size']} CPU processes. Every row trains on "
        "the generated data of its config (`n_train` / `n_test` in the YAML)."
    )
    return "\n".join(lines)


def solvers_body(results: dict) -> str:
    burgers, darcy = results["solvers"]["burgers_nu1e-3"], results["solvers"]["darcy"]
    lines = [
        "| problem | dataset's solve | reference solve | samples | max rel. L2 | mean rel. L2 |",
        "|---|---|---|---|---|---|",
        f"| Burgers, viscosity 1e-3 | {burgers['grid']} points, dt {burgers['dt']:.2e} | {burgers['fine_grid']} "
        f"points, dt {burgers['fine_dt']:.2e} | {burgers['n_samples']} | {burgers['rel_l2_max']:.1e} "
        f"| {burgers['rel_l2_mean']:.1e} |",
        f"| Darcy 2-D | {darcy['solve_grid']} nodes per side | {darcy['fine_grid']} nodes per side | "
        f"{darcy['n_samples']} | {darcy['rel_l2_max']:.1e} | {darcy['rel_l2_mean']:.1e} |",
        "",
        f"Burgers' steepest front spans {burgers['steepest_front_points']:.1f} grid spacings of the 1,024-point "
        "solution: the shocks are resolved, and the solver's error is far below the model errors above. Darcy's "
        "error is the finite-difference scheme's (second order; the paper's own data carry it too), compared at "
        f"the {darcy['grid_size']} x {darcy['grid_size']} training nodes.",
    ]
    return "\n".join(lines)


def render_sections(document: dict) -> dict[str, str]:
    """Section name -> Markdown body, from a science_errors.json document alone (no clock, no measurement)."""
    results = document["results"]
    return {"science problems": problems_body(results), "science solvers": solvers_body(results)}


@exit_on_user_error(FileNotFoundError, ValueError)
def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=CPU_RUNS, help="rows to (re)measure")
    parser.add_argument("--solver-samples", type=int, default=4, help="samples of the solvers' refinement check")
    add_results_options(parser, RESULTS)
    args = parser.parse_args()
    if args.render:
        render_from_file(args.json, render_sections, DOCS)
        return
    kept = {}
    if args.json.exists() and set(args.runs) != set(CPU_RUNS):  # a partial rerun keeps the other rows
        previous = load_document(args.json)
        for row in previous["results"]["runs"]:
            kept[row["name"]] = {**row, "provenance": row_provenance(row, previous["provenance"])}
            kept[row["name"]].pop("git_commit", None)  # now inside the row's provenance
    rows = dict(kept)
    with tempfile.TemporaryDirectory(prefix="zr-science-bench-") as work:
        for name in args.runs:
            rows[name] = run_recipe(name, Path(work) / name)
    order = [name for name in RUNS if name in rows]
    results = {
        "runs": [rows[name] for name in order],
        "world_size": rows[order[0]]["world_size"],
        "solvers": solver_errors(args.solver_samples),
    }
    print(problems_body(results))
    print(solvers_body(results))
    save_and_publish(args, results, render_sections, DOCS)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
