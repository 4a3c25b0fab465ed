"""The communication account (common/communication.py) against bytes computed here by hand, stage by stage."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from bench.communication import LAYOUTS, MICRO_BATCH, SEQ
from common.comms_log import trainable_model
from common.communication import (
    LINK_CLASSES,
    CommSetup,
    Link,
    Transfer,
    compute_seconds,
    expert_capacity,
    fit_link,
    forward_numels,
    link_for,
    links_from_doctor,
    parse_link,
    plan_communication,
    plan_seconds,
    setup_from_ds_config,
    stage3_gathers,
    stage3_module_trace,
    step_share,
    suggested_bucket_elements,
    transfer_seconds,
    with_recipe_moe,
)
from common.errors import ConfigError
from common.memory_formulas import ModelFacts, assumed_transformer
from common.parallel import ParallelLayout
from nlp.moe import MOE_SIZES

# A model of five parameters in forward order: two matrices of 1000, two norms of 10 and a head of 501 elements.
NUMELS = (1000, 10, 1000, 10, 501)
K = sum(NUMELS)  # 2521
FACTS = ModelFacts(num_params=K, param_numels=NUMELS, hidden_size=8, num_layers=1, num_heads=2)
TWO = ParallelLayout(world_size=2)


def plan(stage: int, layout: ParallelLayout = TWO, facts: ModelFacts = FACTS, **setup):
    return plan_communication(facts, CommSetup(stage=stage, **setup), layout)


def norm_check(p) -> float:
    """The gradient norm's (and overflow check's) all-reduced scalars: a few bytes, a call or two per step."""
    return sum(t.message_bytes for t in p.transfers if t.purpose == "gradient norm and overflow check")


def test_stage_0_and_1_all_reduce_every_gradient_once_per_step():
    for stage in (0, 1):
        p = plan(stage, precision="bf16", grad_accum=4)
        assert p.message_bytes("all_reduce") - norm_check(p) == 2 * K  # once per step, not per micro-batch
    # Stage 1 sums a 4-byte norm and a 1-byte overflow flag besides; stage 0 checks neither.
    assert (norm_check(plan(1, precision="bf16")), norm_check(plan(0))) == (5, 0)
    # Stage 1 then gathers each rank's partition of the updated parameters: ceil(2521 / 2) = 1261 elements.
    assert plan(1, precision="bf16").message_bytes("all_gather") == 2 * 1261
    assert plan(0).message_bytes("all_gather") == 0


def test_stage_2_reduces_every_micro_batch():
    p = plan(2, precision="fp32", grad_accum=3, param_groups=2)
    assert p.message_bytes("all_reduce") == 3 * 4 * K + 4  # and the fp32 norm (no overflow check in fp32)
    (gather,) = [t for t in p.transfers if t.collective == "all_gather"]
    assert (gather.message_bytes, gather.calls) == (4 * 1261, 2)  # one call per parameter group


def test_stage_3_gathers_sharded_parameters_every_micro_batch_and_reduce_scatters_every_gradient():
    # Threshold 0: every parameter gathered; shards padded per parameter: 500 + 5 + 500 + 5 + 251 = 1261.
    p = plan(3, precision="bf16", grad_accum=2)
    assert p.message_bytes("all_gather") == 2 * 2 * 1261
    # Reduce-scatter logs the whole (padded) buffer: 1000 + 10 + 1000 + 10 + 502 = 2522 elements per micro-batch.
    assert p.message_bytes("reduce_scatter") == 2 * 2 * 2522
    assert p.message_bytes("all_reduce") == norm_check(p) == 8  # stage 3's norm, in fp64


def test_stage_3_persistent_parameters_are_not_gathered_but_their_gradients_are_reduced():
    p = plan(3, precision="bf16", persistence_threshold=10)
    forward, after_step = [t for t in p.transfers if t.collective == "all_gather"]
    assert forward.message_bytes == 2 * (500 + 500 + 251)
    # Each rank updated its half of the two norms: gathered whole again after the step, one call each.
    assert (after_step.message_bytes, after_step.calls) == (2 * (5 + 5), 2)
    assert p.message_bytes("reduce_scatter") == 2 * 2522


# The five parameters' trace: a container, each parameter's module forward, the container, each again backward.
TRACE = ((), (0,), (1,), (2,), (3,), (4,), (), (4,), (3,), (2,), (1,), (0,))


def gathers(max_reuse_distance: float = 1e9, prefetch_bucket_size: float = 0, max_live_parameters: float = 1e9):
    return stage3_gathers(TRACE, NUMELS, 10, prefetch_bucket_size, max_live_parameters, max_reuse_distance)


def test_stage_3_module_trace_runs_forward_then_backward_in_reverse():
    assert stage3_module_trace(5) == TRACE
    llama = stage3_module_trace(3 + 9 * 2)  # two layers: every parameter fetched once each way
    assert sorted(i for module in llama for i in module) == sorted(2 * list(range(21)))
    assert llama[2] == (0,) and llama[-1] == (0,)  # the embedding first forward, last backward
    # The output layer ends the forward pass after the final norm and, after the causal LM's own step (a container),
    # starts the backward pass.
    head = llama.index((20,))
    assert llama[head - 1] == (19,) and llama[head + 1 : head + 3] == ((), (20,))


def test_stage_3_reuse_distance_decides_the_backward_gather():
    """Worked by hand on TRACE, the norms persistent: after matrix 0's forward (step 1, released at step 2) the
    modules before its backward use (step 11) hold 10 + 1000 + 10 + 501 + 501 + 10 + 1000 + 10 = 3042 elements;
    after matrix 2's, 10 + 501 + 501 + 10 = 1022; after the head's, only the container (0)."""
    assert gathers(3042) == [2, 0, 1, 0, 1] and gathers(3043) == [1, 0, 1, 0, 1]
    assert gathers(1022) == [2, 0, 2, 0, 1] and gathers(1023) == [2, 0, 1, 0, 1]
    assert gathers(0) == [2, 0, 2, 0, 2] and gathers(1) == [2, 0, 2, 0, 1]
    default = plan(3, persistence_threshold=10, prefetch_bucket_size=0)
    short = plan(3, persistence_threshold=10, max_reuse_distance=0, prefetch_bucket_size=0)
    assert short.message_bytes("all_gather") - default.message_bytes("all_gather") == 2 * (500 + 500 + 251)


def test_stage_3_prefetch_keeps_what_it_passed_and_its_live_bound_limits_how_far_it_looks():
    """Reuse distance 0, worked by hand on TRACE. A live bound over the model: the first prefetch walks the whole
    queue, marks every backward use and nothing is released. Bound 2000: the first prefetch gathers matrices 0 and 2;
    matrix 0 is released (its backward use not yet passed), then at the norm the prefetch (1000 free) gathers the head,
    passes the head's and matrix 2's backward uses (both available: marked, so kept) and gathers matrix 0 again ahead
    of its backward use. Bound 1000: one matrix ahead at a time, only the head's backward use is passed in time."""
    assert gathers(0, 5e7, 1e9) == [1, 0, 1, 0, 1]
    assert gathers(0, 5e7, 2000) == [2, 0, 1, 0, 1]
    assert gathers(0, 5e7, 1000) == [2, 0, 2, 0, 1]
    # The release compares the marked use with the step after the module's fetch, strictly: a parameter the very next
    # module uses again is released and gathered again (the reuse distance, when above 0, keeps it).
    assert stage3_gathers(((0,), (0,)), (1000,), 10, 5e7, 1e9, 0) == [2]
    assert stage3_gathers(((0,), (0,)), (1000,), 10, 5e7, 1e9, 1) == [1]
    on = plan(3, max_reuse_distance=0)  # DeepSpeed's prefetch (5e7) and live bound (1e9) hold 2521 elements
    off = plan(3, max_reuse_distance=0, prefetch_bucket_size=0)
    assert on.message_bytes("all_gather") == 2 * 1261
    assert off.message_bytes("all_gather") == 2 * 2 * 1261
    # Prefetch coalesces the gathers: one call per bucket, not one per parameter.
    assert on.calls("all_gather") == 1 and off.calls("all_gather") == 2 * 5


def test_a_bounded_prefetch_on_the_tiny_llama_matches_deepspeeds_log():
    """The bench's row 'stage 3, threshold 0, reuse distance 0, prefetch on, max live 2e6' (the NLP recipe's tiny
    Llama: vocabulary 4096, hidden 256, 4 layers, MLP 688, bf16, 2 ranks): DeepSpeed's comms_logger recorded
    8,683,264 bytes of all-gather per step. The prefetch reached the output layer, the final norm and the last layer
    (1,839,872 elements) before their forward releases: they stay gathered, the rest is gathered twice."""
    h, inter, vocab = 256, 688, 4096
    layer = (h * h, h * h, h * h, h * h, h * inter, h * inter, h * inter, h, h)  # registration order
    numels = (vocab * h, *(layer * 4), h, vocab * h)
    facts = ModelFacts(num_params=sum(numels), param_numels=numels, hidden_size=h, num_layers=4, num_heads=4)
    setup = dict(persistence_threshold=0, max_reuse_distance=0, prefetch_bucket_size=1887436)
    bounded = plan(3, facts=facts, precision="bf16", max_live_parameters=2_000_000, **setup)
    assert bounded.message_bytes("all_gather") == 8_683_264
    kept = vocab * h + h + sum(layer)
    assert bounded.message_bytes("all_gather") == 2 * (2 * sum(n // 2 for n in numels) - kept // 2)


def test_hpz_gathers_the_backward_pass_inside_the_node():
    four = ParallelLayout(world_size=4)
    common = dict(persistence_threshold=10, max_reuse_distance=0, ranks_per_node=2, prefetch_bucket_size=0)
    plain = plan(3, four, **common)
    hpz = plan(3, four, hpz_partition_size=2, **common)
    forward = 2 * (250 + 250 + 126)  # shards over 4 ranks
    backward_hpz = 2 * (500 + 500 + 251)  # shards over the 2 ranks of the node
    norms_after_step = 2 * (3 + 3)  # ceil(10 / 4) elements of each norm
    assert plain.message_bytes("all_gather") == 2 * forward + norms_after_step
    assert hpz.message_bytes("all_gather") == forward + backward_hpz + norms_after_step
    # The backward gather moved off the network: 4 ranks over 2 nodes cross it, hpZ's 2 ranks do not.
    assert hpz.sent_bytes("inter_node") < plain.sent_bytes("inter_node")
    (backward,) = [t for t in hpz.transfers if "backward" in t.purpose]
    assert (backward.group_size, backward.scope) == (2, "intra_node")
    assert backward.sent_bytes == backward_hpz * (2 - 1)  # an all-gather sends its shard to each other rank


def test_quantized_weights_and_gradients_shrink_their_collectives():
    q = plan(3, precision="bf16", quantized_weights=True, quantized_gradients=True)
    assert q.message_bytes("all_gather") == 1 * 1261  # int8
    assert q.message_bytes("reduce_scatter") == 0 and q.message_bytes("all_to_all") == 0.5 * 2522


def test_sent_bytes_follow_the_bus_convention():
    n = 8
    assert Transfer("all_reduce", "", 800, 1, n, "intra_node").sent_bytes == 800 * 2 * 7 / 8
    assert Transfer("reduce_scatter", "", 800, 1, n, "intra_node").sent_bytes == 800 * 7 / 8
    assert Transfer("all_gather", "", 100, 1, n, "intra_node").sent_bytes == 100 * 7  # its shard to 7 others
    assert Transfer("all_gather", "", 100, 1, 1, "intra_node").sent_bytes == 0


def test_one_rank_sends_nothing():
    assert plan(3, ParallelLayout(world_size=1)).transfers == ()


def test_seconds_add_latency_and_bytes_over_the_link():
    link = Link("test", 1e9, 1e-3)
    p = plan(2, precision="fp32")  # all-reduce 4K bytes in one call, all-gather 4 x 1261 in one call, the norm
    expected = (1e-3 + 4 * K * 2 * 1 / 2 / 1e9) + (1e-3 + 4 * 1261 * 1 / 1e9) + (1e-3 + 4 * 2 * 1 / 2 / 1e9)
    assert plan_seconds(p, link) == pytest.approx(expected)


def test_the_share_falls_as_the_link_gets_faster_and_as_tokens_grow():
    facts = assumed_transformer(7_000_000_000)
    layout = ParallelLayout(world_size=32)
    p = plan_communication(facts, CommSetup(stage=3, ranks_per_node=8, persistence_threshold=0), layout)
    shares = []
    for name in ("25gbps", "100gbps", "400gbps"):
        compute = compute_seconds(6 * facts.num_params * 4096 / 32 * 32, 312e12, 0.5)
        shares.append(step_share(p, compute, LINK_CLASSES["nvlink"], LINK_CLASSES[name]).share)
    assert shares[0] > shares[1] > shares[2]
    by_tokens = []
    for tokens in (1024, 4096, 16384):
        compute = compute_seconds(6 * facts.num_params * tokens, 312e12, 0.5)
        by_tokens.append(step_share(p, compute, LINK_CLASSES["nvlink"], LINK_CLASSES["100gbps"]).share)
    assert by_tokens[0] > by_tokens[1] > by_tokens[2]


def test_overlap_hides_at_most_the_compute():
    p = plan(3)
    link = Link("slow", 1e3)
    share = step_share(p, 0.001, link)
    assert share.exposed_s == pytest.approx(share.comm_s - 0.001)
    assert share.exposed_share < share.share


def test_setup_from_a_resolved_config():
    ds = {
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 2560,
            "zero_hpz_partition_size": 8,
            "offload_optimizer": {"device": "cpu"},
            "reduce_bucket_size": 2e6,
        },
    }
    s = setup_from_ds_config(ds, tokens_per_micro_batch=512)
    assert (s.stage, s.precision, s.grad_accum, s.offload, s.persistence_threshold) == (3, "bf16", 4, "optimizer", 2560)
    assert (s.hpz_partition_size, s.reduce_bucket_size, s.tokens_per_micro_batch) == (8, 2e6, 512)
    # DeepSpeed's defaults where the config is silent.
    s = setup_from_ds_config({"zero_optimization": {"stage": 3}})
    assert (s.precision, s.persistence_threshold, s.max_reuse_distance) == ("fp32", 100_000, 1e9)


def test_buckets_scale_with_the_link():
    slow = suggested_bucket_elements(LINK_CLASSES["25gbps"], "bf16")
    fast = suggested_bucket_elements(LINK_CLASSES["nvlink"], "bf16")
    assert 5e7 <= slow < fast <= 2e9


# --- bad inputs: one line each ------------------------------------------------------------------------------------


def test_link_classes_and_figures():
    assert parse_link("NVLink").name == "nvlink" and parse_link("pcie-4").bus_bytes_per_s == 32e9
    assert parse_link("100Gbps").bus_bytes_per_s == pytest.approx(12.5e9)
    assert parse_link("12.5GB/s").bus_bytes_per_s == pytest.approx(12.5e9)
    with pytest.raises(ConfigError, match="did you mean 'nvlink'"):
        parse_link("nvlnk")
    with pytest.raises(ConfigError, match="positive"):
        parse_link("-5GB/s")
    with pytest.raises(ConfigError, match="positive"):
        parse_link("0Gbps")


def doctor_json(world: int) -> dict:
    rows = []
    for op, factor in (("all_reduce", 2 * (world - 1) / world), ("all_gather", (world - 1) / world)):
        for size in (65536, 1 << 20, 16 << 20):
            rows.append({"op": op, "bytes": size, "seconds": 1e-4 + size * factor / 2e9})
    return {"measured": {"world_size": world, "collectives": rows}}


def test_measured_links_from_doctor_fit_latency_and_rate():
    links = links_from_doctor(json.loads(json.dumps(doctor_json(2))), world_size=2)
    assert links.links["all_reduce"].bus_bytes_per_s == pytest.approx(2e9)
    assert links.links["all_gather"].latency_s == pytest.approx(1e-4)
    with pytest.raises(ConfigError, match="measured 2 ranks but the plan has 8"):
        links_from_doctor(doctor_json(2), world_size=8)
    with pytest.raises(ConfigError, match="--collectives"):
        links_from_doctor({"versions": {}}, world_size=2)


def doctor_json_per_dtype(world: int, rates: dict[str, float]) -> dict:
    """doctor.json as ``doctor --collectives --dtypes`` writes it: every row names its buffer's dtype."""
    rows = []
    for dtype, rate in rates.items():
        for op, factor in (("all_reduce", 2 * (world - 1) / world), ("all_gather", (world - 1) / world)):
            for size in (65536, 1 << 20, 16 << 20):
                rows.append({"op": op, "dtype": dtype, "bytes": size, "seconds": 1e-4 + size * factor / rate})
    return {"measured": {"world_size": world, "collectives": rows}}


def test_each_transfer_is_priced_at_the_bandwidth_of_the_dtype_it_moves():
    """A bf16 stage-2 step's gradients and parameters move bf16 buffers: priced at doctor's bf16 fit (here 1.2x slower
    per byte than fp32, as gloo's bf16 all-reduce measured on this CPU), by hand: per transfer latency x calls + bus
    bytes / rate. An fp32 run is priced at the fp32 fit; fp16 borrows bf16's (same width); qgZ's int4 all-to-all
    and a doctor.json from before the dtypes (no ``dtype`` key: fp32 buffers) fall back to fp32's."""
    links = links_from_doctor(doctor_json_per_dtype(2, {"fp32": 2.4e9, "bf16": 2e9}), world_size=2)
    assert links.links["all_reduce"].bus_bytes_per_s == pytest.approx(2.4e9)  # the fp32 fit stays the default
    assert links.by_dtype["bf16"]["all_reduce"].bus_bytes_per_s == pytest.approx(2e9)
    bf16 = plan(2, precision="bf16")
    assert {t.dtype for t in bf16.transfers if t.message_bytes > 64} == {"bf16"}  # all but the norm's scalars

    def by_hand(p, rate: float) -> float:
        return sum(1e-4 * t.calls + t.sent_bytes / rate for t in p.transfers)

    # The norm's scalar all-reduce moves fp32: priced at 2.4e9, a difference of nanoseconds.
    assert plan_seconds(bf16, links) == pytest.approx(by_hand(bf16, 2e9), rel=1e-5)
    fp32 = plan(2, precision="fp32")
    assert plan_seconds(fp32, links) == pytest.approx(by_hand(fp32, 2.4e9), rel=1e-5)
    fp16 = plan(2, precision="fp16")
    assert plan_seconds(fp16, links) == pytest.approx(by_hand(fp16, 2e9), rel=1e-5)
    legacy = links_from_doctor(doctor_json(2), world_size=2)
    assert plan_seconds(bf16, legacy) == pytest.approx(by_hand(bf16, 2e9), rel=1e-5)  # doctor_json's rate: 2e9
    int4 = plan(3, precision="bf16", quantized_gradients=True)
    qgz = next(t for t in int4.transfers if t.collective == "all_to_all")
    assert qgz.dtype == "int4" and link_for(qgz, links, None) is links.links["all_gather"]


def test_a_measured_link_prices_each_call_at_doctors_time_for_its_size():
    """Doctor's points need not lie on a line (gloo's cost per byte changes with the size): a call is priced at the
    time measured for its size, linear between the two sizes around it, by hand here; outside the measured sizes the
    nearest point's time moves at the fit's rate; a dip in the points (noise) never makes a larger call cheaper."""
    kinked = [(1e5, 1e-3), (1e6, 2e-3), (1e7, 40e-3)]  # cheap up to 1 MB, 26 MB/s past it
    link = fit_link("all_reduce", kinked)
    assert link.seconds(2 * 5.5e5, 2) == pytest.approx(2 * 1.5e-3)  # halfway between 1e5 and 1e6: 1.5 ms a call
    assert link.seconds(5.5e6, 1) == pytest.approx(2e-3 + 4.5e6 * 38e-3 / 9e6)
    assert link.seconds(2e7, 1) == pytest.approx(40e-3 + 1e7 / link.bus_bytes_per_s)
    assert link.seconds(3e4, 3) == pytest.approx(3 * max(0.0, 1e-3 - 9e4 / link.bus_bytes_per_s))
    line = link.latency_s + 5.5e5 / link.bus_bytes_per_s  # what the fitted line alone would charge
    assert abs(line - 1.5e-3) > 0.3 * 1.5e-3  # so the first check above tells the two apart
    dipped = fit_link("all_gather", [(1e5, 1e-3), (1e6, 0.5e-3), (1e7, 9e-3)])
    assert dipped.seconds(5.5e5, 1) == pytest.approx(1e-3)  # 1 MB measured faster than 100 kB: read as 1 ms

    # Through doctor.json: a transfer's seconds are its calls at the time for its own message's bus bytes.
    small = [(1e3, 1e-4), (1e4, 2e-4), (1e5, 4e-3)]  # the kink at the test model's sizes (a few kB a bucket)
    rows = [{"op": "all_reduce", "dtype": "bf16", "bytes": size, "seconds": s} for size, s in small]  # 2 ranks:
    links = links_from_doctor({"measured": {"world_size": 2, "collectives": rows}}, world_size=2)  # bus = bytes
    bf16 = plan(2, precision="bf16")
    grads = [t for t in bf16.transfers if t.collective == "all_reduce" and t.dtype == "bf16"]
    sizes = [t.sent_bytes / t.calls for t in grads]
    assert grads and all(1e3 < size < 1e5 for size in sizes)  # inside the measured sizes: numpy's interpolation
    by_hand = sum(t.calls * float(np.interp(size, *zip(*small))) for t, size in zip(grads, sizes, strict=True))
    assert sum(transfer_seconds(t, link_for(t, links, None)) for t in grads) == pytest.approx(by_hand)


def test_sequence_parallel_stage_2_reduces_gradients_in_fp32():
    """stage_1_and_2.allreduce_bucket reduces in fp32 under sequence parallelism: those gradients are priced as fp32."""
    p = plan(2, ParallelLayout(world_size=2, sequence=2), precision="bf16")
    gradients = next(t for t in p.transfers if t.purpose.startswith("gradients"))
    assert gradients.dtype == "fp32" and gradients.message_bytes == 4 * K


def test_bad_setups_are_one_line_errors():
    for kwargs, match in (
        ({"stage": 4}, "stage"),
        ({"stage": 3, "precision": "bf61"}, "did you mean 'bf16'"),
        ({"stage": 3, "grad_accum": 0}, "grad_accum"),
        ({"stage": 3, "reduce_bucket_size": -1}, "reduce_bucket_size"),
    ):
        with pytest.raises(ConfigError, match=match) as err:
            CommSetup(**kwargs)
        assert "\n" not in str(err.value)
    assert math.isfinite(plan_seconds(plan(3), LINK_CLASSES["pcie3"]))


def test_a_bare_parameter_count_gets_a_layer_by_layer_order():
    """``--params`` lumps the matrices; the reuse distance needs them in order: a 7B model re-gathers its early layers
    for the backward pass (their next use lies over 1e9 elements ahead) and keeps the last ones gathered."""
    facts = assumed_transformer(7_000_000_000)
    numels = forward_numels(facts)
    assert sum(numels) == pytest.approx(facts.num_params, rel=1e-6) and len(numels) == 9 * facts.num_layers + 3
    p = plan_communication(facts, CommSetup(stage=3, persistence_threshold=0), ParallelLayout(world_size=8))
    forward, backward = [t.message_bytes for t in p.transfers if t.collective == "all_gather"]
    assert 0.5 * forward < backward < forward
    assert forward_numels(FACTS) == NUMELS  # listed one by one: kept as they are


# A tiny MoE: hidden 256, 2 layers, 4 experts of 10,000 elements (a lump of their own), 2 ranks of expert parallelism.
MOE = ModelFacts(num_params=100_000, hidden_size=256, num_layers=2, num_heads=4, num_experts=4, expert_params=40_000)
EP2 = ParallelLayout(world_size=2, expert=2)


def expert_all_to_all(**setup) -> tuple[float, int]:
    p = plan(2, EP2, MOE, precision="bf16", grad_accum=3, tokens_per_micro_batch=128, **setup)
    moe = [t for t in p.transfers if t.collective == "all_to_all"]
    assert len(moe) == 1
    return moe[0].message_bytes, moe[0].calls


def test_expert_capacity_follows_deepspeeds_formula():
    """sharded_moe._capacity: ceil(tokens / experts x k x capacity_factor), at least min_capacity."""
    assert expert_capacity(128, 4, top_k=2, capacity_factor=1.0, min_capacity=4) == 64  # 128 / 4 x 2
    assert expert_capacity(128, 4, top_k=2, capacity_factor=1.25, min_capacity=4) == 80  # 32 x 2.5
    assert expert_capacity(100, 8, top_k=1, capacity_factor=1.0, min_capacity=4) == 13  # ceil(12.5)
    assert expert_capacity(8, 4, top_k=2, capacity_factor=1.0, min_capacity=6) == 6  # 4, raised to the minimum


def test_expert_all_to_all_with_token_dropping_is_every_slot_at_its_capacity():
    """drop_tokens: each of the 4 all-to-alls of a layer (dispatch, combine; forward, backward) sends the whole
    (experts, capacity, hidden) buffer: 4 x 80 x 256 x 2 B = 163,840 B at capacity 80 (factor 1.25, top-2, 128
    tokens); 2 layers x 4 calls x 3 micro-batches = 24 calls, 3,932,160 B a step."""
    message, calls = expert_all_to_all(moe_drop_tokens=True, moe_capacity_factor=1.25, moe_top_k=2)
    assert calls == 24 and message == 24 * 4 * 80 * 256 * 2 == 3_932_160
    # min_capacity raises a small micro-batch's slot: 128 tokens over 4 experts, top-1, factor 1.0 -> 32 -> 40.
    message, _ = expert_all_to_all(moe_drop_tokens=True, moe_top_k=1, moe_min_capacity=40)
    assert message == 24 * 4 * 40 * 256 * 2
    # Without dropping the slot follows the routing: the factor is the measured one (1.0: even, a lower bound).
    message, _ = expert_all_to_all(moe_drop_tokens=False, moe_capacity_factor=1.0, moe_top_k=2)
    assert message == 24 * 2 * 128 * 256 * 2


def test_the_recipes_token_dropping_keys_reach_the_plan():
    """A recipe config's ``moe_drop_tokens`` and ``moe_min_capacity`` set the planner's; a config without them plans
    DeepSpeed MoE as the recipe builds it by default (no token dropped, DeepSpeed's minimum slot of 4)."""
    base = setup_from_ds_config({"zero_optimization": {"stage": 2}}, 128)
    dropping = with_recipe_moe(base, {"moe_drop_tokens": True, "moe_min_capacity": 40})
    assert (dropping.moe_drop_tokens, dropping.moe_min_capacity, dropping.stage) == (True, 40, 2)
    default = with_recipe_moe(base, {"model": "moe_tiny"})
    assert (default.moe_drop_tokens, default.moe_min_capacity) == (False, 4)


def test_the_benchs_token_dropping_row_tells_a_plan_that_models_dropping_from_one_that_does_not():
    """bench/communication.py's token-dropping row runs the NLP recipe's moe_tiny (4 experts, top-2) on 2 x 64 tokens
    at capacity factor 1: DeepSpeed's capacity there, ceil(128 / 4 x 2) = 64, is exactly the slot even routing fills,
    so a planner that ignored the dropping would match the log as well. The row's ``moe_min_capacity`` raises every
    slot above it: only the plan that models DeepSpeed's capacity matches, the other is 64 / min_capacity of it."""
    keys = next(keys for name, keys in LAYOUTS if "token dropping" in name)
    row = dict(key.split("=", 1) for key in keys)
    assert row["model"] == "moe_tiny" and row["moe_drop_tokens"] == "true"
    size = MOE_SIZES["moe_tiny"]
    experts, top_k, tokens = size["num_local_experts"], size["num_experts_per_tok"], MICRO_BATCH * SEQ
    min_capacity = int(row["moe_min_capacity"])
    even_slot = tokens * top_k // experts  # 64
    assert min_capacity > even_slot
    facts = replace(MOE, num_experts=experts)
    common = dict(precision="bf16", tokens_per_micro_batch=tokens, moe_top_k=top_k, moe_capacity_factor=1.0)
    dropping = plan(2, EP2, facts, moe_drop_tokens=True, moe_min_capacity=min_capacity, **common)
    ignoring = plan(2, EP2, facts, moe_drop_tokens=False, moe_min_capacity=min_capacity, **common)
    layers, h = facts.num_layers, facts.hidden_size
    assert dropping.message_bytes("all_to_all") == 4 * layers * experts * min_capacity * h * 2  # every slot at 80
    assert ignoring.message_bytes("all_to_all") == 4 * layers * experts * even_slot * h * 2  # the even-routing slot
    assert ignoring.message_bytes("all_to_all") < dropping.message_bytes("all_to_all")
    # Without the row's minimum (DeepSpeed's default, 4) the two plans are the same: the row could not tell them apart.
    same = [plan(2, EP2, facts, moe_drop_tokens=d, **common).message_bytes("all_to_all") for d in (True, False)]
    assert same[0] == same[1]


def test_a_partly_frozen_model_is_planned_from_its_trainable_elements_under_stages_0_to_2():
    """LoRA: under stages 0-2 only the trainable parameters' gradients are reduced and their partitions gathered, so
    the plan is that of the trainable elements (by hand: 2 B x 600 reduced, 2 B x 300 gathered at stage 2 over 2
    ranks); stage 3 also gathers the frozen ones, which the planner does not model (None); a model that trains
    every parameter, or one whose counts are unknown, is planned whole."""
    assert trainable_model(FACTS, 2, None) is FACTS and trainable_model(FACTS, 2, (K, K)) is FACTS
    assert trainable_model(FACTS, 3, (600, K)) is None
    lora = trainable_model(FACTS, 2, (600, K))
    p = plan_communication(lora, CommSetup(stage=2, precision="bf16"), TWO)
    gradients = next(t for t in p.transfers if t.purpose.startswith("gradients"))
    assert gradients.message_bytes == 2 * 600 and p.message_bytes("all_gather") == 2 * 300


def test_the_bench_counts_each_call_on_the_rank_that_reached_it_last():
    """Two ranks that take turns arriving last: rank 0 waits 5 ms for rank 1 at the gather, rank 1 waits 7 ms for
    rank 0 at the reduce-scatter; the transfers took 1 and 2 ms. Per call the least is the transfer alone (3 ms); the
    least of the ranks' sums still holds one wait (8 ms)."""
    from bench.communication import last_arrival_seconds, last_arrivals, least_rank_seconds

    def rank(gather: float, scatter: float) -> dict:
        calls = [["all_gather_into_tensor", 4096, gather], ["reduce_scatter_tensor", 8192, scatter]]
        return {"steps": [{"calls": calls, "comm_s": gather + scatter}] * 2}

    ranks = [rank(0.006, 0.002), rank(0.001, 0.009)]
    assert last_arrivals(ranks, 1) == [("all_gather_into_tensor", 0.001), ("reduce_scatter_tensor", 0.002)]
    assert last_arrival_seconds([last_arrivals(ranks, 1)]) == pytest.approx(0.003)
    assert least_rank_seconds(ranks, range(1, 2)) == pytest.approx(0.008)
    # Ranks that logged different calls are not matched call by call: the rank with the least sum, as one call.
    ranks[1]["steps"] = [{"calls": ranks[1]["steps"][0]["calls"][:1], "comm_s": 0.004}] * 2
    assert last_arrivals(ranks, 1) == [("step", 0.004)]
