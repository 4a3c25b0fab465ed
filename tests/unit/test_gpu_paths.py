"""What the GPU and NCCL paths read, checked on a CPU: the flight recorder a hang report reads for its backend, and
the PCIe generation the doctor judges a GPU by.

NCCL's flight-recorder dump (``_dump_nccl_trace_json``) exists only in CUDA builds of torch, so the NCCL case hands
``flight_recorder_entries`` a stand-in module holding two dumps with different entries (which one was read shows
in the result); the gloo case reads the real generic recorder of a one-process gloo group. The doctor's parser gets
the lines ``nvidia-smi --query-gpu`` prints on an idle H200 and on a PCIe 3.0 machine.
"""

from __future__ import annotations

import json
import types

import torch
import torch.distributed as dist

from common.hang import compact_collectives, flight_recorder_dumps, flight_recorder_entries
from common.tools.doctor import hardware_checks, parse_pcie_query, pcie_text


def entry(seq: int, op: str, group: str) -> dict:
    return {"collective_seq_id": seq, "profiling_name": op, "process_group": [group, ""], "input_sizes": [[1]]}


def recorders(with_nccl: bool = True) -> types.SimpleNamespace:
    """torch's two dump functions as a CUDA build has them (NCCL's left out for a CPU build)."""

    def dump(entries: list[dict], group_status: dict) -> callable:
        return lambda include_collectives, only_active: json.dumps({"entries": entries, "pg_status": group_status})

    module = types.SimpleNamespace(_dump_fr_trace_json=dump([entry(3, "gloo:broadcast", "1")], {"1": {"gloo": True}}))
    if with_nccl:
        module._dump_nccl_trace_json = dump([entry(7, "nccl:all_reduce", "0")], {"0": {"nccl": True}})
    return module


def test_a_nccl_run_reads_nccls_flight_recorder_and_its_gloo_groups():
    entries, status, note = flight_recorder_entries("nccl", recorders())
    assert [e["profiling_name"] for e in entries] == ["nccl:all_reduce", "gloo:broadcast"]
    assert status == {"0": {"nccl": True}, "1": {"gloo": True}} and note is None
    assert [(r["group"], r["seq"], r["op"]) for r in compact_collectives(entries)] == [
        ("0", 7, "all_reduce"),
        ("1", 3, "broadcast"),
    ]
    # one backend per device, as init_process_group without a backend makes it
    assert flight_recorder_dumps("cpu:gloo,cuda:nccl") == ("_dump_nccl_trace_json", "_dump_fr_trace_json")


def test_a_gloo_run_reads_the_generic_recorder_only():
    entries, _, note = flight_recorder_entries("gloo", recorders())
    assert [e["profiling_name"] for e in entries] == ["gloo:broadcast"] and note is None


def test_a_torch_without_ncclss_recorder_says_so_and_keeps_the_generic_one():
    entries, _, note = flight_recorder_entries("nccl", recorders(with_nccl=False))
    assert [e["profiling_name"] for e in entries] == ["gloo:broadcast"]
    assert note == "_dump_nccl_trace_json not in this torch build"


def test_the_real_generic_recorder_of_a_gloo_group_holds_its_collective(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(3))
        entries, _, note = flight_recorder_entries()  # the backend from the default group, torch's own dumps
    finally:
        dist.destroy_process_group()
    assert note is None and [r["op"] for r in compact_collectives(entries)][-1] == "all_reduce"


# nvidia-smi --query-gpu=index,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max
IDLE_H200 = "0, 1, 5, 16, 16\n"  # an idle GPU trains its link down to gen 1
PCIE3_MACHINE = "0, 3, 3, 16, 16\n1, [N/A], [N/A], [N/A], [N/A]\n"


def test_an_idle_gen5_gpu_is_judged_by_its_links_maximum():
    links = parse_pcie_query(IDLE_H200, gpu_count=1)
    gpu = {"index": 0, **links[0]}
    assert pcie_text(gpu) == "gen 5 x16 (now gen 1 x16)"
    assert hardware_checks({"gpus": [gpu]}) == []


def test_a_pcie3_link_is_told_to_prefer_zero2_and_a_hidden_link_is_not():
    links = parse_pcie_query(PCIE3_MACHINE, gpu_count=2)
    gpus = [{"index": index, **link} for index, link in sorted(links.items())]
    checks = hardware_checks({"gpus": gpus})
    assert [c.check_id for c in checks] == ["pcie-3-zero3"]
    assert "GPU 0's link reaches PCIe gen 3 x16 at most" in checks[0].message
    assert parse_pcie_query("2, 4, 4, 16, 16\nindex, pcie\n", gpu_count=2) == {}  # no such GPU; a header line
