"""The two-round paired node check names the bad nodes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detect.pairing import GroupResult, diagnose, pair_nodes, repair_suspects
from unicorn_core.errors import InvalidArgument


def run(groups: list[tuple[str, ...]] | tuple[tuple[str, ...], ...], bad: set[str]) -> list[GroupResult]:
    """Simulated tests: a test fails exactly when a bad node takes part."""
    return [
        GroupResult(g, ok=not (set(g) & bad), detail="" if not set(g) & bad else "all-gather timed out")
        for g in groups
    ]


def test_round1_pairs_across_halves() -> None:
    assert pair_nodes(["n1", "n2", "n3", "n4"]) == [("n1", "n3"), ("n2", "n4")]
    assert pair_nodes(["n1", "n2", "n3", "n4", "n5"]) == [("n1", "n4"), ("n2", "n5", "n3")]
    assert pair_nodes(["n1", "n2", "n3"]) == [("n1", "n3", "n2")]
    assert pair_nodes(["n1"]) == [("n1",)]
    assert pair_nodes([]) == []


def test_duplicate_or_empty_names_are_rejected() -> None:
    with pytest.raises(InvalidArgument, match="listed twice"):
        pair_nodes(["n1", "n1"])
    with pytest.raises(InvalidArgument, match="empty node name"):
        pair_nodes(["n1", ""])


def test_one_bad_node_is_named_in_two_rounds() -> None:
    nodes = [f"n{i}" for i in range(1, 9)]
    round1 = run(pair_nodes(nodes), {"n6"})
    assert [r.ok for r in round1] == [True, False, True, True]  # (n2, n6) failed
    plan = repair_suspects(round1)
    assert plan.suspects == ("n2", "n6") and plan.unresolved == ()
    assert len(plan.waves) == 1 and all(len(g) == 2 for g in plan.tests)
    result = diagnose(round1 + run(plan.tests, {"n6"}))
    assert result.bad == ("n6",) and "n2" in result.cleared and result.unresolved == ()


def test_without_any_passing_pair_suspects_are_cross_paired() -> None:
    round1 = run([("a", "b"), ("c", "d")], {"a", "c"})
    plan = repair_suspects(round1)
    assert plan.tests == (("a", "c"), ("b", "d"))
    result = diagnose(round1 + run(plan.tests, {"a", "c"}))
    assert result.bad == ("a", "c") and result.cleared == ("b", "d")


def test_spare_healthy_nodes_are_used_and_reused_over_waves() -> None:
    round1 = run([("a", "b"), ("c", "d")], {"a", "d"})
    plan = repair_suspects(round1, healthy=["spare"])
    assert plan.waves == ((("a", "spare"),), (("b", "spare"),), (("c", "spare"),), (("d", "spare"),))
    assert diagnose(round1 + run(plan.tests, {"a", "d"})).bad == ("a", "d")


def test_single_node_matmul_failure_is_bad_at_once() -> None:
    result = diagnose([GroupResult(("n1",), ok=False, detail="matmul mismatch")])
    assert result.bad == ("n1",)


def test_nothing_failed_nothing_to_do() -> None:
    round1 = run(pair_nodes(["a", "b", "c", "d"]), set())
    plan = repair_suspects(round1)
    assert plan.suspects == () and plan.tests == ()
    assert diagnose(round1).bad == ()


def test_lone_suspect_without_partner_is_unresolved() -> None:
    plan = repair_suspects([GroupResult(("a", "b"), ok=False)])
    assert plan.tests == () and plan.unresolved == ("a", "b")
    assert diagnose([GroupResult(("a", "b"), ok=False)]).unresolved == ("a", "b")


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 24), st.data())
def test_two_rounds_name_exactly_the_bad_nodes(count: int, data: st.DataObject) -> None:
    """With bad nodes in the minority, two rounds never convict a good node nor clear a bad
    one, and name every bad node whenever round 1 cleared at least one partner."""
    nodes = [f"n{i:02d}" for i in range(count)]
    bad = set(data.draw(st.lists(st.sampled_from(nodes), max_size=max(0, (count - 1) // 2), unique=True)))
    round1 = run(pair_nodes(nodes), bad)
    plan = repair_suspects(round1)
    results = round1 + run(plan.tests, bad)
    verdict = diagnose(results)
    assert set(verdict.bad) <= bad  # never a good node
    assert not set(verdict.cleared) & bad  # never clears a bad node
    if any(r.ok for r in round1):  # a cleared partner existed for round 2
        assert set(verdict.bad) == bad
