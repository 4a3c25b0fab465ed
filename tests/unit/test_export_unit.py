"""``common.tools.export``'s pure parts: where ZeRO puts each parameter's elements, shard planning, sizes, refusals.

The layouts are checked against DeepSpeed's own arithmetic (``zero_to_fp32``'s partition sizes) on flat vectors
built the way DeepSpeed partitions them; the whole export runs on real checkpoints in
tests/recipes/test_export.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.errors import ConfigError
from common.tools.export import (
    export_checkpoint,
    join_slices,
    locate,
    parse_size,
    plan_shards,
    reference_prefix,
    strip_prefix,
    tensor_difference,
    verify_failures,
)
from common.tools.zero_files import (
    JoinedSource,
    TensorSource,
    load_structure,
    span_pieces,
    zero3_layout,
    zero12_layout,
)

SHAPES = [
    {"embed.weight": torch.Size([7, 3]), "layer.weight": torch.Size([5, 5]), "layer.bias": torch.Size([5])},
    {"norm.weight": torch.Size([3]), "head.weight": torch.Size([11])},
]


def zero3_partitions(values: dict[str, torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """Each rank's flat vector as ZeRO-3 builds it: every parameter padded to a multiple of the world size, split."""
    ranks: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for tensor in values.values():
        flat = tensor.reshape(-1)
        padded = torch.cat([flat, flat.new_zeros((-flat.numel()) % world_size)])
        for rank, part in enumerate(padded.chunk(world_size)):
            ranks[rank].append(part)
    return [torch.cat(parts) for parts in ranks]


def shaped_values(shapes: list[dict[str, torch.Size]]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: torch.randn(shape) for group in shapes for name, shape in group.items()}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_zero3_layout_reassembles_every_parameter(world_size):
    from deepspeed.utils.zero_to_fp32 import zero3_partitioned_param_info

    values = shaped_values(SHAPES)
    flats = zero3_partitions(values, world_size)
    layout = zero3_layout(SHAPES, world_size)
    assert list(layout) == list(values)
    for name, (offset, partition) in layout.items():
        assert partition == zero3_partitioned_param_info(values[name].numel(), world_size)[0]
        whole = torch.cat([flat[offset : offset + partition] for flat in flats])[: values[name].numel()]
        assert torch.equal(whole.view(values[name].shape), values[name]), name


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("with_paddings", [False, True])
def test_zero12_layout_and_span_pieces_reassemble_across_rank_boundaries(world_size, with_paddings):
    values = shaped_values(SHAPES)
    paddings = [[1, 0, 2], [0, 3]] if with_paddings else None
    layout, ends = zero12_layout(SHAPES, paddings)
    for group, shapes in enumerate(SHAPES):
        # ZeRO-1/2 keep one vector per group (parameters + alignment paddings), padded and cut into equal parts.
        pieces = []
        for i, name in enumerate(shapes):
            pieces += [values[name].reshape(-1), torch.zeros(paddings[group][i] if paddings else 0)]
        vector = torch.cat(pieces)
        assert ends[group] == vector.numel()
        vector = torch.cat([vector, torch.zeros((-vector.numel()) % (2 * world_size))])
        partitions = list(vector.chunk(world_size))
        lengths = [p.numel() for p in partitions]
        for name, shape in shapes.items():
            assert layout[name][0] == group
            runs = span_pieces(lengths, layout[name][1], math.prod(shape))
            whole = torch.cat([partitions[r][s : s + n] for r, s, n in runs])
            assert torch.equal(whole.view(shape), values[name]), name


def test_span_pieces_cuts_at_the_boundaries():
    assert span_pieces([4, 4, 4], 3, 6) == [(0, 3, 1), (1, 0, 4), (2, 0, 1)]
    assert span_pieces([4, 4], 4, 4) == [(1, 0, 4)]
    assert span_pieces([4, 0, 4], 2, 4) == [(0, 2, 2), (2, 0, 2)]


def test_plan_shards_keeps_order_and_the_limit():
    sizes = {"a": 40, "b": 40, "c": 30, "big": 500, "d": 10}
    assert plan_shards(sizes, 100) == [["a", "b"], ["c"], ["big"], ["d"]]
    assert plan_shards(sizes, 10_000) == [list(sizes)]
    for shard in plan_shards(sizes, 100):
        assert sum(sizes[n] for n in shard) <= 100 or len(shard) == 1


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5gb") == 1_500_000_000
    assert parse_size("1234") == 1234
    for bad in ("five", "5XB", "-1GB", "0"):
        with pytest.raises(ConfigError, match="max-shard-size"):
            parse_size(bad)


def test_strip_prefix_finds_the_lightning_wrapper_and_refuses_a_foreign_model():
    wanted = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert strip_prefix(["model.model.embed_tokens.weight", "model.lm_head.weight"], wanted) == "model."
    assert strip_prefix(["model.embed_tokens.weight", "lm_head.weight"], wanted) == ""
    with pytest.raises(ConfigError, match="do not match the run's model"):
        strip_prefix(["encoder.conv.weight"], wanted)


def test_out_dir_refusal_and_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="OUT_DIR .*full already exists and is not empty; pass --overwrite"):
        export_checkpoint(tmp_path / "absent", tmp_path / "full")
    # An absent or empty folder, or a full one with overwrite, passes: the export stops at the missing checkpoint.
    for out_dir, overwrite in (("absent_out", False), ("empty", False), ("full", True)):
        with pytest.raises(ConfigError, match="does not exist"):
            export_checkpoint(tmp_path / "absent", tmp_path / out_dir, overwrite=overwrite)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="not a DeepSpeed ZeRO checkpoint: expected a run directory"):
        locate(tmp_path / "full")
    with pytest.raises(ConfigError, match="does not exist"):
        locate(tmp_path / "absent")


def test_locate_follows_the_pointers_from_every_folder_a_user_points_at(tmp_path):
    """The run, its checkpoints/, one step_* folder and the tag folder all find the same tag folder."""
    run = tmp_path / "run"
    tag = run / "checkpoints" / "step_000004" / "checkpoint"
    tag.mkdir(parents=True)
    (run / "config.yaml").write_text("preset: nlp\n")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (run / "checkpoints" / "latest").write_text("step_000004")
    (tag.parent / "latest").write_text("checkpoint")
    for start in (run, run / "checkpoints", tag.parent, tag):
        assert locate(start) == (tag, run), start
    (tag.parent / "latest").write_text("gone")
    with pytest.raises(ConfigError, match="names 'gone'"):
        locate(run / "checkpoints")
    (tag.parent / "latest").write_text(".")  # a pointer to itself: an error, not a loop
    with pytest.raises(ConfigError, match="not a DeepSpeed ZeRO checkpoint"):
        locate(tag.parent)


def test_a_pickled_class_outside_the_allow_list_is_refused_by_name(tmp_path):
    from fractions import Fraction

    path = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"param_shapes": [], "lr": Fraction(1, 3)}, path)
    with pytest.raises(ConfigError, match="pickles fractions.Fraction, which export does not load"):
        load_structure(path)
    path.write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match="corrupt or unreadable checkpoint shard: .*model_states.pt"):
        load_structure(path)


def test_reference_prefix_maps_exported_names_onto_deepspeeds_names():
    keys = {"model.model.embed.weight", "model.model.norm.weight", "model.lm_head.weight", "other.weight"}
    assert reference_prefix(["model.embed.weight", "lm_head.weight"], keys) == "model."
    assert reference_prefix(["other.weight"], keys) == ""
    with pytest.raises(ConfigError, match="not the names in DeepSpeed's consolidation"):
        reference_prefix(["model.embed.weight", "head.weight"], keys)
    with pytest.raises(ConfigError):  # a suffix of a name is not a name: "ther.weight" is not "other.weight"
        reference_prefix(["ther.weight"], keys)


def test_tensor_difference_and_what_fails_a_verification():
    a = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert tensor_difference(a, a.clone()) == 0.0
    assert tensor_difference(a, a + 0.5) == 0.5
    assert tensor_difference(a, a.view(3, 2)) == math.inf
    assert tensor_difference(torch.tensor([1, 2]), torch.tensor([1, 3])) == math.inf
    passed = {"differing": [], "missing": [], "max_abs_param_diff": 0.0, "max_abs_logit_diff": 0.0}
    assert verify_failures(passed) == []
    failed = verify_failures({**passed, "differing": ["w"], "max_abs_param_diff": 0.5, "missing": ["b"]})
    assert failed == ["1 tensors differ (e.g. w, max abs difference 0.5)", "1 tensors are missing (e.g. b)"]
    assert verify_failures({**passed, "max_abs_logit_diff": 1e-6}) == ["logits differ by up to 1e-06"]


# --- tensor-parallel slices: which dimension joins them (the data is checked end to end in the TP recipe test) ---


def slice_of(*shape: int) -> TensorSource:
    return TensorSource(torch.Size(shape), ())


@pytest.mark.parametrize(
    ("slices", "whole", "expected"),
    [
        ([(64, 32), (64, 32)], (64, 32), None),  # replicated (embedding, norm): slice 0
        ([(32, 64), (32, 64)], (64, 64), 0),  # column-parallel (q/k/v, gate/up): rows
        ([(64, 16), (64, 16)], (64, 32), 1),  # row-parallel (o_proj, down_proj): columns
        ([(64,), (64,)], None, None),  # a buffer the model does not save: slice 0
    ],
    ids=["replicated", "column", "row", "buffer"],
)
def test_tensor_parallel_slices_join_along_the_dimension_they_split(slices, whole, expected):
    parts = [slice_of(*shape) for shape in slices]
    joined = join_slices("w", parts, torch.Size(whole) if whole else None)
    if expected is None:
        assert joined is parts[0]
    else:
        assert isinstance(joined, JoinedSource) and joined.dim == expected and joined.shape == torch.Size(whole)


@pytest.mark.parametrize(
    "slices", [[(32, 64), (16, 64)], [(32, 32), (32, 32)], [(64, 16, 1), (64, 16, 1)]], ids=["sum", "two-dims", "rank"]
)
def test_slices_that_do_not_join_into_the_model_are_refused(slices):
    with pytest.raises(ConfigError, match="do not join into the model's"):
        join_slices("w", [slice_of(*shape) for shape in slices], torch.Size((64, 64)))
