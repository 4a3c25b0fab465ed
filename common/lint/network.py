"""Rules on the network a run crosses: stage 3 over a slow link between nodes, buckets out of scale with the link.

The network is stated by ``zero-recipes lint --network LINK`` or by a recipe config's ``network`` key (a link class or a
rate, ``common.communication.parse_link``), so the rules run wherever lint does: the command on a recipe YAML, and
every recipe at its start (``common.lint.lint_at_start``). Without a stated network they say nothing."""

from __future__ import annotations

from common.communication import GBPS, Link, parse_link, suggested_bucket_elements
from common.lint.view import Finding, LintView, Rule
from common.memory_formulas import WORKING_BYTES, fmt_gb

# Practitioners report ZeRO-3's communication within 15 % of the step on 100 Gbit/s InfiniBand; below that, the
# estimate's worked examples (docs/choosing_a_stage.md) spend most of a step communicating at usual batch sizes.
FAST_NETWORK_BYTES_PER_S = 100 * GBPS
# A bucket this many times off the link's suggestion is out of scale (the suggestion moves in 5 ms a call).
BUCKET_SCALE_FACTOR = 4


def stated_network(view: LintView) -> Link | None:
    """The link the data-parallel group crosses: the ``--network`` flag's, else the recipe config's ``network`` key;
    None when neither states one.

    Raises:
        ConfigError: a ``network`` key that names no link (the message names the nearest link class).
    """
    if view.network is not None:
        return view.network
    name = (view.recipe_config or {}).get("network")
    return parse_link(str(name)) if name else None


def rule_stage3_slow_network(view: LintView) -> list[Finding]:
    """Stage 3 across nodes over a link below 100 Gbit/s: three times the parameter bytes every micro-batch."""
    link = stated_network(view)
    nodes = view.world_size // max(1, view.ranks_per_node)
    if link is None or view.stage != 3 or nodes <= 1 or link.bus_bytes_per_s >= FAST_NETWORK_BYTES_PER_S:
        return []
    figure = ""
    if view.num_params:
        n = view.world_size
        precision = view.precision if view.precision in WORKING_BYTES else "bf16"
        # Forward all-gather, backward re-gather and gradient reduce-scatter: (n - 1) / n of the 16-bit model each.
        sent = 3 * WORKING_BYTES[precision] * view.num_params * (n - 1) / n
        figure = f": about {fmt_gb(sent)} a rank every micro-batch, {sent / link.bus_bytes_per_s:.3g} s at its rate"
    return [
        Finding(
            "stage3-slow-network",
            "warning",
            f"ZeRO stage 3 across {nodes} nodes over {link.name} (below 100 Gbit/s){figure}; DeepSpeed 0.19's stage 2 "
            "moves about as much (it all-reduces its buckets every micro-batch)",
            "see the share of the step: zero-recipes estimate --network LINK; raise the tokens per micro-batch, set "
            "zero_hpz_partition_size to the ranks per node (hpZ: backward gathers inside the node), or a faster link",
        )
    ]


def rule_bucket_link_scale(view: LintView) -> list[Finding]:
    """reduce/allgather buckets more than 4x off the size the link moves in 5 ms (smaller buckets on a slow
    network, larger on a fast interconnect: each call should take a few ms, not hide behind its latency)."""
    link = stated_network(view)
    if link is None or view.stage == 0:
        return []
    precision = view.precision if view.precision in WORKING_BYTES else "bf16"
    suggested = suggested_bucket_elements(link, precision)
    findings = []
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        value = view.zero.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            continue
        seconds = value * WORKING_BYTES[precision] / link.bus_bytes_per_s
        if value > BUCKET_SCALE_FACTOR * suggested:
            what = "large for a slow link: each call holds the overlap for"
        elif value * BUCKET_SCALE_FACTOR < suggested:
            what = "small for a fast link: the calls' latency dominates, each moves for only"
        else:
            continue
        findings.append(
            Finding(
                "bucket-link-scale",
                "warning",
                f"{key}={value:.3g} is {what} {seconds * 1e3:.3g} ms over {link.name}",
                f"{key}: {suggested:.3g} (what {link.name} moves in about 5 ms a call; zero-recipes estimate --network "
                "prints it)",
            )
        )
    return findings


RULES: dict[str, Rule] = {
    "stage3-slow-network": rule_stage3_slow_network,
    "bucket-link-scale": rule_bucket_link_scale,
}
