"""StepSampler: ranks disjoint, order fixed by (seed, step), resume continues exactly."""

from common.data import StepSampler


def indices(rank, start, max_steps=6, world=2):
    return list(StepSampler(50, 4, 2, rank, world, seed=3, start_step=start, max_steps=max_steps))


def test_ranks_disjoint_within_a_step():
    r0, r1 = indices(0, 0), indices(1, 0)
    for step in range(6):
        a, b = set(r0[step * 8 : step * 8 + 8]), set(r1[step * 8 : step * 8 + 8])
        assert not a & b


def test_resume_sees_the_same_batches():
    full = indices(0, 0)
    resumed = indices(0, 3)
    assert resumed == full[3 * 8 :]
    assert len(StepSampler(50, 4, 2, 0, 2, seed=3, start_step=3, max_steps=6)) == len(resumed)


def test_seed_changes_order():
    a = list(StepSampler(50, 4, 1, 0, 1, seed=1, start_step=0, max_steps=5))
    b = list(StepSampler(50, 4, 1, 0, 1, seed=2, start_step=0, max_steps=5))
    assert a != b and sorted(set(a)) == sorted(a)


def test_full_length_claims_the_whole_run_but_yields_the_rest():
    # Lightning counts a resumed epoch's batches from the checkpoint's count: its loader claims the whole run.
    resumed = StepSampler(50, 4, 2, 0, 2, seed=3, start_step=3, max_steps=6, full_length=True)
    assert len(resumed) == 6 * 2 * 4
    assert list(resumed) == list(StepSampler(50, 4, 2, 0, 2, seed=3, start_step=3, max_steps=6))
