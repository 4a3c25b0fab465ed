"""``common.parallel.ParallelLayout``'s rank map against DeepSpeed's own topologies, and its degrees' arithmetic.

The pipeline engine places ranks by ``PipeDataParallelTopology`` and ``ProcessTopology`` (axes in order, the last
fastest): the layout's stage and replica of every rank must be DeepSpeed's coordinates, or a replica's stages would
read different batches. The multi-process check of the same map on a live engine is ``check_mesh`` in the recipe
tests.
"""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, ProcessTopology

from common.parallel import ParallelLayout


@pytest.mark.parametrize(("pp", "dp"), [(2, 1), (2, 2), (4, 2), (3, 5)])
def test_pipeline_stage_and_replica_are_deepspeeds_coordinates(pp, dp):
    topology = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    layout = ParallelLayout(pp * dp, pipeline=pp)
    for rank in range(pp * dp):
        coord = topology.get_coord(rank)
        assert (layout.pipeline_stage(rank), layout.data_parallel_rank(rank)) == (coord.pipe, coord.data), rank


@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (2, 2), (4, 2), (2, 4)])
def test_tensor_parallel_groups_are_consecutive_ranks_of_one_replica(dp, tp):
    # AutoTP's mesh is (data, tensor), the tensor axis fastest: the same order as a (data, tensor) ProcessTopology.
    topology = ProcessTopology(axes=["data", "tensor"], dims=[dp, tp])
    layout = ParallelLayout(dp * tp, tensor=tp)
    for rank in range(dp * tp):
        coord = topology.get_coord(rank)
        assert (layout.data_parallel_rank(rank), layout.tensor_rank(rank)) == (coord.data, coord.tensor), rank
    assert layout.data_parallel == dp and layout.zero_ranks == dp


def test_sequence_and_expert_ranks_and_the_degrees():
    layout = ParallelLayout(8, sequence=2)
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.sequence_rank(r) for r in range(8)] == [0, 1] * 4
    assert (layout.data_parallel, layout.zero_ranks, layout.ranks_per_replica) == (4, 8, 2)
    experts = ParallelLayout(8, expert=4)
    assert [experts.expert_rank(r) for r in range(8)] == [0, 1, 2, 3] * 2 and experts.expert_data_parallel == 2
    assert not ParallelLayout(4, pipeline=1).on_pipeline_engine
    assert ParallelLayout(4, pipeline=1, pipeline_engine=True).on_pipeline_engine
    assert ParallelLayout(4, pipeline=2).on_pipeline_engine
