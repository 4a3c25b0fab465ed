"""The probe's outputs: its rows and result, ``report.md``, ``report.json``, ``probe.png`` and ``recommended.yaml``.

:mod:`common.tools.probe` runs the candidates and recommends one; this module only writes what it found.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.comms_log import communication_beside_plan, read_comms_log
from common.config import dump_yaml
from common.describe import RecipeDescription
from common.memory_formulas import link_seconds_range, offload_traffic
from common.tools.recipes import describe

# Keys the probe sets on every candidate; the recommended config takes them from the base config instead.
PROBE_KEYS = ("preset", "activation_checkpointing", "max_steps", "out_dir", "overwrite", "resume", "devices")


@dataclass
class ProbeRow:
    """What one candidate measured (per rank, rank 0's process), or why it did not run."""

    candidate: str
    preset: str
    activation_checkpointing: str
    zero_stage: int | None
    offload: str
    status: str  # "ok", "failed: <last error line>", "interrupted"
    out_of_memory: bool = False
    peak_memory_bytes: int | None = None
    model_state_bytes_per_rank: int | None = None
    throughput: float | None = None
    throughput_unit: str | None = None
    step_time_s: float | None = None
    wall_time_s: float | None = None
    world_size: int | None = None
    memory_kind: str | None = None
    out_dir: str = ""
    log: str = ""
    command: list[str] = field(default_factory=list)
    # Per collective, per optimizer step: DeepSpeed's logged bytes, calls and seconds beside the planner's bytes
    # (communication_summary); None when the candidate logged no step.
    communication: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """Whether the candidate ran to the end."""
        return self.status == "ok"


@dataclass
class ProbeResult:
    """Everything the probe writes."""

    recipe: str
    backend: str
    devices: int
    steps: int
    config: str
    rows: list[ProbeRow] = field(default_factory=list)
    recommendation: dict[str, Any] = field(default_factory=dict)
    device_memory_bytes: float | None = None
    device_memory_label: str = ""
    interrupted: bool = False
    recommended_config: str | None = None
    script: str = ""  # the candidates' entry script, as a command names it
    offload_timing: list[dict[str, Any]] = field(default_factory=list)  # planner vs measured, per offload row
    sequence_parallel: int = 1  # Ulysses: processes splitting each sequence, in every candidate

    def to_json(self) -> dict[str, Any]:
        """``report.json``."""
        data = asdict(self)
        data["rows"] = [asdict(r) for r in self.rows]
        return data


# --- helpers the recommendation and the report share ----------------------------------------------------


def fastest(rows: list[ProbeRow]) -> ProbeRow:
    """The row with the highest throughput."""
    return max(rows, key=lambda r: r.throughput or 0.0)


def fmt_peak(row: ProbeRow) -> str:
    """A row's peak memory per rank, ``1.23 GB``."""
    return f"{row.peak_memory_bytes / 1e9:.2f} GB" if row.peak_memory_bytes else "n/a"


def fmt_rate(row: ProbeRow) -> str:
    """A row's throughput per device, ``1,234 tokens/s``."""
    if row.throughput is None:
        return "-"
    unit = (row.throughput_unit or "").replace("/device", "")
    return f"{row.throughput:,.0f} {unit}".strip()


def user_overrides(overrides: list[str] | None) -> list[str]:
    """The user's ``key=value`` overrides without the keys the probe sets on each candidate."""
    return [o for o in overrides or [] if o.partition("=")[0].strip() not in PROBE_KEYS]


def write_config_yaml(config: dict[str, Any], path: Path, header: list[str]) -> Path:
    """A recipe config (``--describe``'s ``config``) as a YAML the recipe reads with ``--config``, under ``# `` lines.

    A file, not ``key=value`` overrides: the whole resolved config, so the run is the one that was described.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"# {line}\n" for line in header) + dump_yaml(config))
    return path


def offload_counterpart(row: ProbeRow, rows: list[ProbeRow]) -> ProbeRow | None:
    """The measured row an offload row adds its tier to: NVMe over parameter offload to host RAM when that ran
    (the disk is the only difference), else the same stage without offload; same activation checkpointing."""
    wanted = ("params", "none") if row.offload == "nvme" else ("none",)
    for offload in wanted:
        for other in rows:
            if (
                other.ok
                and other.step_time_s
                and other.offload == offload
                and other.zero_stage == row.zero_stage
                and other.activation_checkpointing == row.activation_checkpointing
            ):
                return other
    return None


def offload_timing(
    rows: list[ProbeRow],
    num_params: int,
    world_size: int,
    ranks_per_node: int,
    precision: str,
    bandwidth_gbps: dict[str, tuple[float, float]],
) -> list[dict[str, Any]]:
    """Per offload row: the step time it added over its counterpart, beside the planner's time column for it.

    The planner's figure (``zero-recipes estimate``'s ``offload s/step >=``) is the bytes one optimizer step moves
    over the links the tier adds, divided by their bandwidth (``bandwidth_gbps``: typical ranges, or measured
    figures given with ``--bandwidth``), the slowest link counted: for NVMe over host-RAM offload only the disk,
    otherwise every offload link.
    """
    timing = []
    for row in rows:
        if not row.ok or row.offload == "none" or not row.step_time_s or row.zero_stage is None:
            continue
        counterpart = offload_counterpart(row, rows)
        if counterpart is None:
            continue
        traffic = offload_traffic(num_params, row.zero_stage, row.offload, world_size, precision)
        if counterpart.offload == "params":
            traffic = {"nvme": traffic["nvme"]}
        seconds, link = link_seconds_range(traffic, ranks_per_node, bandwidth_gbps)
        timing.append(
            {
                "candidate": row.candidate,
                "compared_with": counterpart.candidate,
                "measured_s": row.step_time_s - counterpart.step_time_s,
                "planner_s": seconds[link],
                "link": link,
                "bandwidth_gbps": bandwidth_gbps[link],
            }
        )
    return timing


def format_offload_timing(timing: list[dict[str, Any]]) -> list[str]:
    """The report's "what offload cost" table; nothing when no offload row has a counterpart."""
    if not timing:
        return []
    lines = [
        "",
        "What each offload tier added to a step, measured, beside the planner's time column "
        "(`zero-recipes estimate`, offload s/step >=: bytes per step over the slowest link the tier adds / its "
        "bandwidth; pass this machine's figures with `--bandwidth LINK=GB/s`):",
        "",
        "| candidate | compared with | measured: s/step added | planner: s/step | link (GB/s) |",
        "|---|---|---|---|---|",
    ]
    for t in timing:
        low, high = t["planner_s"]
        planner = f"{low:.3f}" if abs(high - low) < 1e-12 else f"{low:.3f}-{high:.3f}"
        rate_low, rate_high = t["bandwidth_gbps"]
        rate = f"{rate_low:g}" if rate_low == rate_high else f"{rate_low:g}-{rate_high:g}"
        lines.append(
            f"| {t['candidate']} | {t['compared_with']} | {t['measured_s']:+.3f} | {planner} | {t['link']} ({rate}) |"
        )
    return lines


def communication_summary(log_folder: Path, run: RecipeDescription) -> dict[str, Any] | None:
    """A candidate's communication per optimizer step: rank 0's DeepSpeed log beside the planner's bytes for the same
    config (common.comms_log.communication_beside_plan; None when the run logged no step after the first)."""
    ranks = read_comms_log(log_folder) if log_folder.is_dir() else {}
    return communication_beside_plan(ranks.get(0, []), run, param_groups=2)


def format_communication(rows: list[ProbeRow]) -> list[str]:
    """The report's communication table: one line per candidate and collective; nothing when none was logged."""
    logged = [r for r in rows if r.communication]
    if not logged:
        return []
    lines = [
        "",
        "Communication per optimizer step, rank 0 (DeepSpeed's `comms_logger` over each candidate's first steps, the "
        "first left out: it records stage 3's trace; the logger is off for the rest of the run, since it synchronises "
        "the device after every collective; median of the logged steps; "
        "message bytes as DeepSpeed counts them: a whole buffer for an all-reduce or reduce-scatter, the rank's shard "
        "for an all-gather), beside the planner's bytes for the same config. DeepSpeed times stage 3's asynchronous "
        "all-gathers at their launch only, so their seconds are a floor:",
        "",
        "| candidate | collective | calls | logged MB | planned MB | logged s |",
        "|---|---|---|---|---|---|",
    ]
    for r in logged:
        for name, c in r.communication["collectives"].items():
            lines.append(
                f"| {r.candidate} | {name} | {c['calls']:.0f} | {c['logged_bytes'] / 1e6:.3f} | "
                f"{c['planned_bytes'] / 1e6:.3f} | {c['logged_s']:.4f} |"
            )
    return lines


# --- reports ------------------------------------------------------------------------------------------


def format_report_md(result: ProbeResult) -> str:
    """``report.md``: the recommendation first, then one table row per candidate."""
    rec = result.recommendation
    lines = [
        f"# zero-recipes probe: {result.recipe}",
        "",
        f"{result.backend}, {result.devices} processes, {result.steps} steps per candidate, config "
        f"`{result.config}`" + (" — **interrupted**: rows measured so far" if result.interrupted else ""),
        "",
    ]
    if result.sequence_parallel > 1:
        sp = result.sequence_parallel
        lines += [
            f"Sequence parallel {sp} (Ulysses) in every candidate: each sequence is split over {sp} processes, "
            f"{result.devices // sp} data-parallel replica(s); ZeRO shards over all {result.devices} processes.",
            "",
        ]
    if rec.get("candidate"):
        lines += [
            f"**Recommended: `{rec['preset']}`** with activation_checkpointing `{rec['activation_checkpointing']}`"
            f" — {rec['reason']}.",
            "",
        ]
        if result.recommended_config:
            lines += [
                f"Config: `{result.recommended_config}` — run it with "
                f"`python {result.script} --config {result.recommended_config}`.",
                "",
            ]
    else:
        lines += [f"**No recommendation** — {rec.get('reason', 'nothing measured')}.", ""]
    base_rows = [r for r in result.rows if r.ok and r.zero_stage == 2 and r.offload == "none" and r.throughput]
    base = fastest(base_rows) if base_rows else None
    lines += [
        "| candidate | stage | offload | status | peak memory / rank | model states / rank | throughput / device "
        f"| vs {base.candidate if base else 'stage 2'} | step time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        relative = f"{r.throughput / base.throughput:.2f}x" if base and r.throughput else "-"
        status = r.status if r.ok else ("**does not fit** — " if r.out_of_memory else "") + r.status
        peak = f"{r.peak_memory_bytes / 1e6:,.0f} MB" if r.peak_memory_bytes else "-"
        states = f"{r.model_state_bytes_per_rank / 1e6:,.1f} MB" if r.model_state_bytes_per_rank else "-"
        step = f"{r.step_time_s:.3f} s" if r.step_time_s else "-"
        lines.append(
            f"| {r.candidate} | {r.zero_stage} | {r.offload} | {status.replace('|', '/')} | {peak} | "
            f"{states} | {fmt_rate(r)} | {relative} | {step} |"
        )
    lines += format_offload_timing(result.offload_timing)
    lines += format_communication(result.rows)
    kind = next((r.memory_kind for r in result.rows if r.memory_kind), None)
    lines += [
        "",
        "![peak memory vs throughput](probe.png)",
        "",
        f"Peak memory is {kind or 'the recipe’s peak_memory_bytes'} of rank 0 (on a CPU the process's peak RSS, "
        "interpreter and libraries included); model states are the bytes the DeepSpeed engine holds per rank; "
        "throughput is the recipe's median step after warm-up. Device memory: "
        + (
            f"{result.device_memory_bytes / 1e9:.1f} GB ({result.device_memory_label})."
            if result.device_memory_bytes
            else "unknown."
        ),
        "",
        "Ladder (fastest first): stage 2 is the baseline; more than 5 % slower than stage 1 -> suspect the network; "
        "stage 3 only when stage 2 does not fit or cannot grow the batch (under 20 % of the device left); offload "
        "last. Each candidate's output is in its log (`logs/` next to this report).",
    ]
    return "\n".join(lines) + "\n"


def plot_probe(result: ProbeResult, path: Path) -> None:
    """``probe.png``: peak memory per rank (x) against throughput per device (y), one point per candidate.

    Failed candidates sit on the right edge as red crosses ("does not fit"); the recommended one is a
    star; the device's memory, when known and in range, is a dashed line.
    """
    # matplotlib here, not at the top: every zero-recipes command imports this module, one probe draws.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    ok = [r for r in result.rows if r.ok and r.peak_memory_bytes and r.throughput is not None]
    failed = [r for r in result.rows if not r.ok]
    chosen = result.recommendation.get("candidate")
    xs = [r.peak_memory_bytes / 1e9 for r in ok]
    x_max = max(xs) * 1.25 if xs else 1.0
    colours = {0: "tab:gray", 1: "tab:blue", 2: "tab:green", 3: "tab:purple"}
    for i, r in enumerate(sorted(ok, key=lambda r: (r.peak_memory_bytes, r.throughput))):
        x, y = r.peak_memory_bytes / 1e9, r.throughput
        star = r.candidate == chosen
        offset = (8, 6) if i % 2 == 0 else (8, -13)  # alternate above/below so neighbours do not overlap
        ax.scatter(
            [x],
            [y],
            s=260 if star else 70,
            marker="*" if star else "o",
            color=colours.get(r.zero_stage or 0, "tab:orange") if r.offload == "none" else "tab:orange",
            edgecolor="black" if star else "none",
            zorder=3,
        )
        ax.annotate(
            r.candidate + ("  (recommended)" if star else ""),
            (x, y),
            textcoords="offset points",
            xytext=offset,
            fontsize=8,
            fontweight="bold" if star else "normal",
        )
    y_vals = [r.throughput for r in ok] or [1.0]
    for i, r in enumerate(failed):
        y = min(y_vals) + (max(y_vals) - min(y_vals)) * (i + 1) / (len(failed) + 1) if len(ok) > 1 else y_vals[0]
        ax.scatter([x_max], [y], marker="x", s=80, color="tab:red", zorder=3)
        label = "does not fit" if r.out_of_memory else ("interrupted" if r.status == "interrupted" else "failed")
        ax.annotate(
            f"{r.candidate}: {label}",
            (x_max, y),
            textcoords="offset points",
            xytext=(-8, 6),
            ha="right",
            fontsize=8,
            color="tab:red",
        )
    if result.device_memory_bytes and result.device_memory_bytes / 1e9 <= x_max * 1.5:
        ax.axvline(result.device_memory_bytes / 1e9, linestyle="--", color="tab:red", alpha=0.5)
    legend = [Line2D([], [], marker="o", linestyle="", color=c, label=f"stage {s}") for s, c in colours.items()]
    legend += [
        Line2D([], [], marker="o", linestyle="", color="tab:orange", label="offload"),
        Line2D([], [], marker="x", linestyle="", color="tab:red", label="failed / does not fit"),
    ]
    ax.legend(handles=legend, loc="lower right", fontsize=8, framealpha=0.8)
    unit = next((r.throughput_unit for r in ok if r.throughput_unit), "per device")
    ax.set_xlabel("peak memory per rank (GB) - left is smaller")
    ax.set_ylabel(f"throughput ({unit}) - up is faster")
    ax.set_xlim(left=0, right=x_max * 1.05)
    ax.set_ylim(bottom=0, top=max(y_vals) * 1.2)
    ax.grid(alpha=0.3)
    title = f"zero-recipes probe: {result.recipe} ({result.backend}, {result.devices} processes)"
    if chosen:
        title += f"\nrecommended: {chosen}"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_recommended_config(
    result: ProbeResult, base_config: Path | None, overrides: list[str], path: Path
) -> Path | None:
    """The base config + the user's overrides + the chosen preset, as a YAML the recipe loads with ``--config``.

    The recipe resolves it (``--describe``): the file holds every key, as the run will see it.
    """
    rec = result.recommendation
    if not rec.get("candidate"):
        return None
    chosen = [f"preset={rec['preset']}", f"activation_checkpointing={rec['activation_checkpointing']}"]
    run = describe(result.recipe, base_config, [*user_overrides(overrides), *chosen])
    header = [
        f"Written by zero-recipes probe: {rec['preset']} with activation_checkpointing "
        f"{rec['activation_checkpointing']}.",
        f"  python {result.script} --config {path}",
        "Why: " + rec["reason"].replace("\n", " "),
        f"Base config: {base_config or 'the recipe default'}; probe-only keys (max_steps, out_dir) are the base's.",
    ]
    return write_config_yaml(run.config, path, header)


def write_reports(result: ProbeResult, out: Path) -> None:
    """``report.json``, ``report.md`` and ``probe.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    (out / "report.md").write_text(format_report_md(result))
    plot_probe(result, out / "probe.png")


def write_reports_partial(result: ProbeResult, out: Path) -> None:
    """``report.json`` after each candidate, so that a crash of the probe itself keeps the rows measured."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({**result.to_json(), "partial": True}, indent=2) + "\n")
