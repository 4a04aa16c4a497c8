"""Token-balanced data parallelism (`titanrl/distributed/balance.py`): the plan. `balance_units`
(the gather and the exchange) runs for real in test_train.py's 2-rank runs (groups move, the
update and the response-length tail still match one rank)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.distributed.balance import assign, loads

costs_st = st.lists(st.lists(st.integers(1, 2000), max_size=12), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(costs_st)
def test_every_unit_lands_once_and_every_rank_keeps_one(costs_by_rank):
    plan = assign(costs_by_rank)
    placed = sorted(u for units in plan for u in units)
    assert placed == sorted((r, i) for r, costs in enumerate(costs_by_rank) for i in range(len(costs)))
    unmoved = [[(r, i) for i in range(len(c))] for r, c in enumerate(costs_by_rank)]
    if plan != unmoved:  # a move: every rank has a unit, and the peak went down
        assert all(plan)
        assert max(loads(costs_by_rank, plan)) < max(map(sum, costs_by_rank))
    if sum(map(len, costs_by_rank)) < len(costs_by_rank):  # fewer units than ranks: nothing moves
        assert plan == unmoved
    assert assign(costs_by_rank) == plan  # every rank computes the same plan


@settings(max_examples=200, deadline=None)
@given(costs_st)
def test_greedy_bound_most_loaded_rank_within_one_unit_of_the_mean(costs_by_rank):
    units = [c for costs in costs_by_rank for c in costs]
    if len(units) < len(costs_by_rank):
        return
    most = max(loads(costs_by_rank, assign(costs_by_rank)))
    # Largest-first to the least loaded: the last unit placed on the most loaded rank found it
    # at most at the mean, so the peak is at most mean + the largest unit; never above unmoved.
    assert most <= sum(units) / len(costs_by_rank) + max(units)
    assert most <= max(sum(c) for c in costs_by_rank)


def test_a_plan_that_would_not_lower_the_peak_moves_nothing():
    costs = [[3, 3], [2, 2, 2]]  # greedy would give 3 + 2 + 2 = 7 to one rank
    assert assign(costs) == [[(0, 0), (0, 1)], [(1, 0), (1, 1), (1, 2)]]


def test_one_long_group_keeps_a_rank_to_itself():
    # The long-tail step: rank 0 generated the one long group and seven short ones.
    costs = [[1900] + [110] * 7, [110] * 8]
    plan = assign(costs)
    assert plan[0] == [(0, 0)]
    assert loads(costs, plan) == [1900, 1650]  # was [2670, 880]


def test_equal_loads_move_nothing():
    costs = [[300, 100], [100, 300]]
    assert assign(costs) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
