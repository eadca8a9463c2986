"""The dynamic program is exact: it matches brute force on random small instances."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plan.objective import gains
from plan.solver import brute_force, objective_of, solve, useful_counts
from unicorn_core.errors import InvalidArgument


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[np.ndarray], int]:
    """Random F tables (zeros where infeasible), current allocation, faults -> G tables."""
    workers = draw(st.integers(0, 7))
    m = draw(st.integers(1, 4))
    running_s = draw(st.floats(1.0, 1000.0))
    out = []
    for _ in range(m):
        waf = np.array(draw(st.lists(st.floats(0.0, 100.0), min_size=workers + 1, max_size=workers + 1)))
        waf[0] = 0.0
        holes = draw(st.lists(st.booleans(), min_size=workers + 1, max_size=workers + 1))
        waf[np.array(holes)] = 0.0
        current = draw(st.integers(0, workers))
        out.append(
            gains(
                waf,
                current=current,
                current_waf=float(waf[current]),
                faulted=draw(st.booleans()),
                running_s=running_s,
                transition_s=draw(st.floats(0.0, 2000.0)),
            )
        )
    return out, workers


@settings(max_examples=150, deadline=None)
@given(instances())
def test_dp_equals_brute_force(instance: tuple[list[np.ndarray], int]) -> None:
    g, workers = instance
    dp = solve(g, workers)
    bf = brute_force(g, workers)
    assert sum(dp.workers) <= workers
    assert dp.objective == pytest.approx(bf.objective, rel=1e-12, abs=1e-9)
    assert objective_of(g, dp.workers) == pytest.approx(dp.objective, rel=1e-12, abs=1e-9)


def _argmax_over_counts(gains_: list[np.ndarray], workers: int) -> tuple[int, ...]:
    """The allocation the solver gave before it went count by count: the (n+1) x |K|
    candidate matrix of each step and its argmax (the first maximum on a tie)."""
    n = workers
    best = np.zeros(n + 1)
    choices = []
    for g in gains_:
        counts = useful_counts(g)
        padded = np.concatenate((np.full(n, -np.inf), best))
        candidates = np.stack([padded[n - k : 2 * n + 1 - k] + g[k] for k in counts], axis=1)
        pick = candidates.argmax(axis=1)
        best = candidates[np.arange(n + 1), pick]
        choices.append(counts[pick])
    allocation = [0] * len(gains_)
    j = n
    for i in range(len(gains_) - 1, -1, -1):
        allocation[i] = int(choices[i][j])
        j -= allocation[i]
    return tuple(allocation)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 40),
    st.lists(st.lists(st.integers(-3, 3), min_size=41, max_size=41), min_size=1, max_size=6),
)
def test_ties_go_to_the_smallest_count_as_an_argmax_over_the_counts(
    workers: int, steps: list[list[int]]
) -> None:
    """Plans are cached by their inputs (unicornd.replan), so the solver must give the same
    allocation for the same gains, ties included: small integer steps make ties everywhere."""
    g = [np.cumsum(np.array(s[: workers + 1], dtype=float)) for s in steps]
    assert solve(g, workers).workers == _argmax_over_counts(g, workers)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-50, 50), min_size=1, max_size=12))
def test_useful_counts_are_the_strict_prefix_maxima(values: list[float]) -> None:
    g = np.array(values)
    kept = set(useful_counts(g).tolist())
    assert 0 in kept
    for k in range(1, len(values)):
        assert (k in kept) == all(g[k] > g[j] for j in range(k))


def test_dense_tables_use_every_column() -> None:
    rng = np.random.default_rng(3)
    g = [np.sort(rng.random(9)) for _ in range(3)]  # strictly increasing: nothing is dominated
    assert solve(g, 8).objective == pytest.approx(brute_force(g, 8).objective)


def test_spare_workers_are_allowed() -> None:
    g = [np.array([0.0, 5.0, 1.0, 1.0])]
    assert solve(g, 3).workers == (1,)


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(InvalidArgument, match="4 entries"):
        solve([np.zeros(3)], 3)
    with pytest.raises(InvalidArgument, match="non-finite"):
        solve([np.array([0.0, np.inf])], 1)
