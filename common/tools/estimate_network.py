"""The network half of ``zero-recipes estimate``: communication seconds per step, their share of the step, and a
recommendation that fits in memory *and* keeps communication within a share of the step.

Only with ``--network`` or ``--bandwidth-from``; without them ``estimate`` prints what it always printed. Per row, the
collectives of one optimizer step (:func:`common.communication.plan_communication`, checked against DeepSpeed's
``comms_logger`` by bench/communication.py) go over the link their group crosses: the node's link inside a node, the
network when the data-parallel group spans nodes (a ring runs at its slowest link). Compute is the dense model's
6 x parameters x tokens per rank per step (Kaplan et al. 2020; attention's own FLOPs left out, so compute is a lower
bound and the share an upper one) over the device's dense peak at a stated utilisation, or a measured step time.
The share is communication / (communication + compute) with nothing overlapped; *exposed* is what is left when
``overlap_comm`` hides the gradient reductions and prefetched gathers under compute (every ZeRO preset turns it on),
never the all-gather after the optimizer step. The recommendation's bar is the exposed share.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.communication import (
    LINK_CLASSES,
    CommSetup,
    Link,
    MeasuredLinks,
    link_for,
    links_from_doctor,
    parse_link,
    plan_communication,
    step_share,
    suggested_bucket_elements,
    training_flops_per_rank,
    transfer_seconds,
)
from common.errors import ConfigError
from common.memory_formulas import GB, WORKING_BYTES, ModelFacts, fmt_gb
from common.parallel import rank_params

# A plan, its inputs and its rows are common.tools.memory's Plan, PlanInputs and Row (which imports this module).
Plan = PlanInputs = Row = Any

DEFAULT_PEAK_TFLOPS = 312.0  # A100's dense bf16 peak (NVIDIA's datasheet): the worked examples' device
DEFAULT_UTILISATION = 0.5  # of that peak in the matrix multiplies: a stated assumption, not a measurement
DEFAULT_MAX_SHARE = 0.15  # practitioners report ZeRO-3's communication within 15 % of the step on 100 Gbps
GUIDE_LINKS = ("25gbps", "100gbps")  # rules of thumb: below 25 Gbps use ZeRO-2; 15 % on 100 Gbps


@dataclass(frozen=True)
class NetworkInputs:
    """The links and the compute a plan's seconds come from.

    Attributes:
        intra: the link inside a node (a link class, a figure, or the collectives doctor measured).
        inter: the network between nodes (None on one node).
        label: where the links come from, in words.
        peak_flops: the device's dense peak, FLOP/s (unused with ``step_seconds``).
        utilisation: the share of that peak the step's matrix multiplies reach.
        step_seconds: a measured compute time per optimizer step (replaces FLOPs / peak).
        grad_accum: micro-batches per optimizer step.
        max_share: the exposed communication share a recommended plan must stay within.
    """

    intra: Link | MeasuredLinks
    inter: Link | MeasuredLinks | None
    label: str
    peak_flops: float = DEFAULT_PEAK_TFLOPS * 1e12
    utilisation: float = DEFAULT_UTILISATION
    step_seconds: float | None = None
    grad_accum: int = 1
    max_share: float = DEFAULT_MAX_SHARE


# --- the command line ---------------------------------------------------------------------------------------------


def add_arguments(p: Any) -> None:
    """``estimate``'s network flags."""
    p.add_argument(
        "--network",
        default=None,
        help="the link the data-parallel group crosses: between nodes with --nodes > 1, else inside the node: "
        f"{', '.join(LINK_CLASSES)} or a figure (12.5GB/s, 100Gbps); adds communication seconds per step",
    )
    p.add_argument("--node-link", default=None, help="with --nodes > 1: the link inside a node (default nvlink)")
    p.add_argument(
        "--bandwidth-from",
        default=None,
        metavar="DOCTOR_JSON",
        help="measured bus bandwidths per collective (the file 'doctor --collectives' writes), instead of --network",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help=f"the device's dense peak, TFLOP/s (default {DEFAULT_PEAK_TFLOPS:g}: A100 bf16)",
    )
    p.add_argument(
        "--utilisation",
        type=float,
        default=None,
        help=f"share of the peak the step reaches (default {DEFAULT_UTILISATION:g})",
    )
    p.add_argument("--step-time", type=float, default=None, help="a measured compute time per step, seconds")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step (default 1)")
    p.add_argument(
        "--max-comm-share",
        type=float,
        default=None,
        help=f"percent of the step communication may take, exposed (default {DEFAULT_MAX_SHARE * 100:g})",
    )


COMPUTE_FLAGS = {
    "node_link": "--node-link",
    "peak_tflops": "--peak-tflops",
    "utilisation": "--utilisation",
    "step_time": "--step-time",
    "grad_accum": "--grad-accum",
    "max_comm_share": "--max-comm-share",
}


def network_from_args(args: Any, world_size: int, nodes: int) -> NetworkInputs | None:
    """The network inputs of a command line, or None without ``--network`` / ``--bandwidth-from``.

    Raises:
        ConfigError: one line for an unknown link class (naming the nearest), a bandwidth that is not positive, a
            doctor.json that is unreadable, lacks measured collectives or was measured over another number of ranks,
            a utilisation outside (0, 1], a share outside (0, 100), and the network's flags without a network.
    """
    network, measured = getattr(args, "network", None), getattr(args, "bandwidth_from", None)
    if network is None and measured is None:
        for attribute, flag in COMPUTE_FLAGS.items():
            if getattr(args, attribute, None) is not None:
                raise ConfigError(f"{flag} goes with --network or --bandwidth-from (communication seconds)")
        return None
    if network is not None and measured is not None:
        raise ConfigError("--network and --bandwidth-from both give the links: pass one")
    if measured is not None:
        links = links_from_doctor(_read_json(measured), world_size)
        intra: Link | MeasuredLinks = links
        inter: Link | MeasuredLinks | None = links if nodes > 1 else None
        label = f"measured by doctor --collectives over {links.world_size} ranks ({measured})"
    elif nodes > 1:
        intra, inter = parse_link(args.node_link or "nvlink"), parse_link(network)
        label = f"inside a node {intra.name}, between nodes {inter.name}"
    else:
        intra, inter = parse_link(network), None
        label = f"inside the node {intra.name}"
    if args.step_time is not None and not args.step_time > 0:
        raise ConfigError(f"--step-time must be a positive number of seconds, got {args.step_time}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ConfigError(f"--peak-tflops must be positive, got {args.peak_tflops}")
    utilisation = DEFAULT_UTILISATION if args.utilisation is None else args.utilisation
    if not 0 < utilisation <= 1:
        raise ConfigError(f"--utilisation is a share of the peak in (0, 1], got {utilisation}")
    share = DEFAULT_MAX_SHARE * 100 if args.max_comm_share is None else args.max_comm_share
    if not 0 < share < 100:
        raise ConfigError(f"--max-comm-share is a percent in (0, 100), got {share}")
    if args.grad_accum is not None and args.grad_accum < 1:
        raise ConfigError(f"--grad-accum must be >= 1, got {args.grad_accum}")
    return NetworkInputs(
        intra=intra,
        inter=inter,
        label=label,
        peak_flops=(args.peak_tflops or DEFAULT_PEAK_TFLOPS) * 1e12,
        utilisation=utilisation,
        step_seconds=args.step_time,
        grad_accum=args.grad_accum or 1,
        max_share=share / 100,
    )


def _read_json(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--bandwidth-from: no such file {path!r}") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"--bandwidth-from: {path!r} is not a doctor.json ({err.__class__.__name__})") from None


# --- per row ----------------------------------------------------------------------------------------------------


def tokens_per_rank_step(inputs: PlanInputs, net: NetworkInputs) -> float:
    """Tokens one rank computes per optimizer step: micro batch x sequence x micro-batches, its SP slice."""
    return inputs.micro_batch_size * inputs.seq_len * net.grad_accum / inputs.layout.sequence


def compute_seconds_per_step(facts: ModelFacts, inputs: PlanInputs, net: NetworkInputs) -> float:
    """Measured, or 6 x the rank's parameters x its tokens over peak x utilisation."""
    if net.step_seconds is not None:
        return net.step_seconds
    params = sum(rank_params(facts, inputs.layout))
    return training_flops_per_rank(params, tokens_per_rank_step(inputs, net)) / (net.peak_flops * net.utilisation)


# The row's zero_optimization keys that decide its collectives (kept in the row, so that checks rerun the same config).
ZERO_KEYS = (
    "stage3_param_persistence_threshold",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
)


def row_network(
    facts: ModelFacts, inputs: PlanInputs, net: NetworkInputs, stage: int, zero: dict[str, Any]
) -> dict[str, Any]:
    """A row's communication: seconds per step, its share, what overlap leaves exposed, the terms, a bucket size."""
    setup = CommSetup(
        stage=stage,
        precision=inputs.precision,
        grad_accum=net.grad_accum,
        persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 0)) if stage == 3 else 0,
        hpz_partition_size=int(zero.get("zero_hpz_partition_size", 1)),
        quantized_weights=bool(zero.get("zero_quantized_weights", False)),
        quantized_gradients=bool(zero.get("zero_quantized_gradients", False)),
        reduce_bucket_size=float(zero.get("reduce_bucket_size", 5e8)),
        prefetch_bucket_size=float(zero.get("stage3_prefetch_bucket_size", 5e7)),
        max_live_parameters=float(zero.get("stage3_max_live_parameters", 1e9)),
        tokens_per_micro_batch=inputs.micro_batch_size * inputs.seq_len,
        ranks_per_node=inputs.gpus_per_node,
    )
    comm = plan_communication(facts, setup, inputs.layout)
    compute = compute_seconds_per_step(facts, inputs, net)
    share = step_share(comm, compute, net.intra, net.inter)
    terms = []
    for t in comm.transfers:
        link = link_for(t, net.intra, net.inter)
        seconds = transfer_seconds(t, link)
        if seconds > 0:
            terms.append(
                {
                    "collective": t.collective,
                    "purpose": t.purpose,
                    "sent_bytes": t.sent_bytes,
                    "calls": t.calls,
                    "link": link.name,
                    "bus_bytes_per_s": link.bus_bytes_per_s,
                    "latency_s": link.latency_s,
                    "measured_sizes": bool(link.points),  # priced at doctor's time for its size, not the fit
                    "seconds": seconds,
                }
            )
    slowest = net.inter if net.inter is not None else net.intra
    # Buckets hold gradients in the run's precision: size them at that dtype's measured all-reduce fit.
    slowest_link = slowest if isinstance(slowest, Link) else slowest.for_dtype(inputs.precision).get("all_reduce")
    return {
        "comm_seconds": share.comm_s,
        "compute_seconds": compute,
        "overlappable_seconds": share.overlappable_s,
        "exposed_seconds": share.exposed_s,
        "comm_share": share.share,
        "exposed_share": share.exposed_share,
        "within_max_share": share.exposed_share <= net.max_share,
        "sent_bytes_intra_node": comm.sent_bytes("intra_node"),
        "sent_bytes_inter_node": comm.sent_bytes("inter_node"),
        "suggested_bucket_elements": suggested_bucket_elements(slowest_link, inputs.precision)
        if slowest_link
        else None,
        "zero": {k: zero[k] for k in ZERO_KEYS if k in zero},
        "terms": terms,
    }


def fmt_comm(row: Row) -> str:
    """The table's column: ``1.23 s 45%/12%`` (seconds per step, share, exposed share)."""
    net = row.network
    if not net:
        return "-"
    return f"{net['comm_seconds']:.3g} s {net['comm_share']:.0%}/{net['exposed_share']:.0%}"


# --- the recommendation ----------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %" if x >= 0.01 else f"{x * 100:.1f} %"


def _describe(row: Row) -> str:
    net = row.network or {}
    return (
        f"{net['comm_seconds']:.3g} s of communication a step against {net['compute_seconds']:.3g} s of compute: "
        f"{_pct(net['comm_share'])} of the step, {_pct(net['exposed_share'])} exposed with overlap"
    )


def network_recommendation(
    result: Plan,
    recommend: Callable[..., dict[str, Any]],
    replan: Callable[[ModelFacts, PlanInputs], Plan],
    rung_name: Callable[[Row], str],
) -> dict[str, Any]:
    """The memory ladder again, now also asking each row to keep its exposed communication within the bar.

    When the row memory alone recommends is over the bar, the reason says so and names the alternatives with their
    numbers: a row that fits and is within (what the ladder then recommends), stage 3 with hpZ (backward gathers
    inside the node), more nodes for stage 2. When nothing fitting is within the bar, the memory recommendation stands
    and says it is over: never silently.
    """
    net = result.inputs.network
    memory_rec = result.recommendation
    if net is None or memory_rec.get("stage") is None:
        return memory_rec
    memory_rec = {**memory_rec, "guide_stage3_shares": guide_shares(result)}
    rows = {(r.stage, r.offload): r for r in result.rows}
    chosen = rows[(memory_rec["stage"], memory_rec["offload"])]
    bar = net.max_share
    if chosen.network and chosen.network["within_max_share"]:
        return {
            **memory_rec,
            "network": chosen.network | {"max_share": bar},
            "reason": memory_rec["reason"] + f"; network: {_describe(chosen)}, within {_pct(bar)}",
        }
    over = f"{rung_name(chosen)} {_describe(chosen)}, over the {_pct(bar)} bar"
    within = recommend(result, accept=lambda r: bool(r.network and r.network["within_max_share"]))
    alternatives = _alternatives(result, chosen, replan, rung_name)
    if within.get("stage") is not None:
        better = rows[(within["stage"], within["offload"])]
        return {
            **within,
            "memory_only": {k: memory_rec[k] for k in ("stage", "offload", "preset")},
            "network": better.network | {"max_share": bar},
            "alternatives": alternatives,
            "reason": f"{over}; {within['reason']}; network: {_describe(better)}, within {_pct(bar)}",
        }
    names = "; ".join(a["text"] for a in alternatives) or "none found"
    return {
        **memory_rec,
        "network": chosen.network | {"max_share": bar},
        "over_max_share": True,
        "alternatives": alternatives,
        "reason": f"{memory_rec['reason']} — OVER THE COMMUNICATION BAR: {over}, and no row that fits keeps within "
        f"it; alternatives: {names}",
    }


def _alternatives(
    result: Plan, chosen: Row, replan: Callable[[ModelFacts, PlanInputs], Plan], rung_name: Callable[[Row], str]
) -> list[dict[str, Any]]:
    """The other rows that fit, stage 3 with hpZ and with all of ZeRO++ across nodes, and, when stage 2 does not fit,
    the fewest nodes (up to 8x) on which it does: each with its shares."""
    inputs, facts, net = result.inputs, result.model, result.inputs.network
    found = []

    def add(what: str, numbers: dict[str, Any], text: str, **extra: Any) -> None:
        shares = f"{_pct(numbers['comm_share'])} of the step, {_pct(numbers['exposed_share'])} exposed"
        found.append(
            {
                "what": what,
                "comm_share": numbers["comm_share"],
                "exposed_share": numbers["exposed_share"],
                "text": f"{text}: {shares}",
                **extra,
            }
        )

    for row in result.rows:
        if row.fits and row.network and row is not chosen:
            add(rung_name(row), row.network, rung_name(row))
    if chosen.stage == 3 and inputs.nodes > 1 and net is not None and chosen.network:
        g = inputs.gpus_per_node
        secondary = WORKING_BYTES[inputs.precision] * facts.num_params / g
        hpz = chosen.network["zero"] | {"zero_hpz_partition_size": g}
        text = f"stage 3 with hpZ (zero_hpz_partition_size={g}: backward gathers inside the node, + {fmt_gb(secondary)}"
        add("hpz", row_network(facts, inputs, net, 3, hpz), text + " a rank)", extra_bytes_per_rank=secondary)
        zeropp = hpz | {"zero_quantized_weights": True, "zero_quantized_gradients": True}
        text = "stage 3 with ZeRO++ (hpZ + int8 weights + int4 gradients; CUDA only)"
        add("zero++", row_network(facts, inputs, net, 3, zeropp), text)
    stage2 = next((r for r in result.rows if (r.stage, r.offload) == (2, "none")), None)
    if stage2 is not None and not stage2.fits and net is not None:
        unbarred = replace(net, max_share=1.0)  # keeps the plan on more nodes from looking for alternatives itself
        for factor in (2, 4, 8):
            more = replan(facts, replace(inputs, nodes=inputs.nodes * factor, network=unbarred))
            row = next((r for r in more.rows if (r.stage, r.offload) == (2, "none")), None)
            if row is not None and row.fits and row.network:
                nodes = inputs.nodes * factor
                add("nodes", row.network, f"{nodes} nodes, where stage 2 fits", nodes=nodes)
                break
    return found


# --- output ------------------------------------------------------------------------------------------------------


def network_lines(result: Plan, rung_name: Callable[[Row], str]) -> list[str]:
    """What the communication column assumed, the stage-3 share over 25 and 100 Gbps, and the terms, one by one."""
    inp, net = result.inputs, result.inputs.network
    if net is None:
        return []
    tokens = tokens_per_rank_step(inp, net)
    if net.step_seconds is not None:
        compute = f"a measured {net.step_seconds:g} s of compute per step (--step-time)"
    else:
        params = sum(rank_params(result.model, inp.layout))
        compute = (
            f"6 x {params / 1e9:.4g}B parameters x {tokens:,.0f} tokens a rank a step (micro batch "
            f"{inp.micro_batch_size} x seq {inp.seq_len} x {net.grad_accum} micro-batches) / "
            f"({net.peak_flops / 1e12:g} TFLOP/s x {net.utilisation:g} utilisation) = "
            f"{compute_seconds_per_step(result.model, inp, net):.3g} s"
        )
    text = (
        f"comm s share/exp.: links {net.label}; compute {compute}. Share = comm / (comm + compute), nothing "
        "overlapped; exposed = what overlap_comm leaves (gradient reductions and prefetched gathers hide under "
        f"compute, the all-gather after the step does not). Bar: exposed <= {_pct(net.max_share)} (--max-comm-share)."
    )
    lines = textwrap.wrap(text, width=110, subsequent_indent="  ")
    lines += textwrap.wrap(_guide_check(result), width=110, initial_indent="  ", subsequent_indent="    ")
    chosen = result.recommendation
    shown = {(3, "none")}
    if chosen.get("stage") is not None:
        shown.add((chosen["stage"], chosen["offload"]))
    for row in result.rows:
        if (row.stage, row.offload) in shown and row.network:
            how = (
                "calls x doctor's measured time a call at its size"
                if any(term.get("measured_sizes") for term in row.network["terms"])
                else "bus bytes a rank sends / bus rate + calls x latency"
            )
            lines.append(f"  {rung_name(row)}, term by term ({how}):")
            for term in row.network["terms"]:
                arithmetic = _term_arithmetic(term)
                lines.append(f"    {term['collective']:<14} {arithmetic} = {term['seconds']:.3g} s  {term['purpose']}")
            bucket = row.network["suggested_bucket_elements"]
            if bucket:
                lines.append(f"    suggested reduce/allgather bucket for this link: {bucket:.3g} elements")
    return lines


def guide_shares(result: Plan) -> dict[str, dict[str, float]]:
    """The two network rules of thumb checked, not assumed: stage 3's share with its data-parallel traffic over 25 and
    100 Gbps (between nodes on several nodes; on one node as the ranks' only link), at the plan's batch and compute."""
    inp, net = result.inputs, result.inputs.network
    row = next((r for r in result.rows if (r.stage, r.offload) == (3, "none")), None)
    if net is None or row is None:
        return {}
    zero = (row.network or {}).get("zero", {})
    shares = {}
    for name in GUIDE_LINKS:
        link = LINK_CLASSES[name]
        check = replace(net, intra=link if inp.nodes == 1 else net.intra, inter=link if inp.nodes > 1 else None)
        numbers = row_network(result.model, inp, check, 3, zero)
        shares[name] = {"comm_share": numbers["comm_share"], "exposed_share": numbers["exposed_share"]}
    return shares


def _term_arithmetic(term: dict) -> str:
    """How a term's seconds were priced: over a nominal link bytes / rate + calls x latency; over a measured one,
    calls x doctor's time a call at the call's size (between the sizes it measured)."""
    if term.get("measured_sizes"):
        per_call_ms = term["seconds"] / term["calls"] * 1e3
        return f"{term['calls']} x {per_call_ms:.3g} ms (doctor's time at {fmt_gb(term['sent_bytes'] / term['calls'])})"
    return (
        f"{fmt_gb(term['sent_bytes']):>9} / {term['bus_bytes_per_s'] / GB:g} GB/s + {term['calls']} x "
        f"{term['latency_s'] * 1e6:g} us"
    )


def _guide_check(result: Plan) -> str:
    shares = guide_shares(result)
    if not shares:
        return ""
    parts = [f"{name} {_pct(s['comm_share'])} ({_pct(s['exposed_share'])} exposed)" for name, s in shares.items()]
    where = "between nodes" if result.inputs.nodes > 1 else "as the ranks' only link"
    return (
        f"rules of thumb checked: stage 3 with its data-parallel traffic {where} over "
        + ", over ".join(parts)
        + " of the step, at this batch and compute"
    )
