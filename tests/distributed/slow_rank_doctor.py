"""``zero-recipes doctor`` with one rank made slower: every ``torch.matmul`` on it sleeps first.

    torchrun --nproc_per_node 2 tests/distributed/slow_rank_doctor.py --slow-rank 1 -- --collectives --out DIR

For tests/distributed/test_hang.py: the doctor must name that rank. The slowdown lives here, not in the tool.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

from common.tools import cli

SLEEP_PER_MATMUL_S = 0.005  # a 512 x 512 float32 matmul takes 1-3 ms on one core here: this rank runs 3-5x slower


def slowed(matmul):
    @functools.wraps(matmul)
    def sleep_then_multiply(*args, **kwargs):
        time.sleep(SLEEP_PER_MATMUL_S)
        return matmul(*args, **kwargs)

    return sleep_then_multiply


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow-rank", type=int, required=True)
    parser.add_argument("doctor_args", nargs=argparse.REMAINDER, help="after --: the doctor's own arguments")
    args = parser.parse_args()
    if int(os.environ.get("RANK", 0)) == args.slow_rank:
        torch.matmul = slowed(torch.matmul)
    doctor_args = args.doctor_args[1:] if args.doctor_args[:1] == ["--"] else args.doctor_args
    return cli.main(["doctor", *doctor_args])


if __name__ == "__main__":
    sys.exit(main())
