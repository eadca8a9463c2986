"""The two-round paired node check: which node is bad, from small tests between nodes.

Round 1 (:func:`pair_nodes`) splits the nodes into disjoint pairs; each pair runs a
small all-gather and a matmul (the caller runs them; this module only decides). A
failing pair says one of its two nodes is bad, not which. Round 2
(:func:`repair_suspects`) re-pairs every suspect with a node known to be good, so the
test isolates it; :func:`diagnose` then names the bad nodes from all results.

Assumption: a bad node makes every test it takes part in fail. Hence a passing test
clears all its members, and a failing test whose other members are all cleared
convicts its remaining member.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from unicorn_core.errors import InvalidArgument

Group = tuple[str, ...]
"""Nodes tested together (two, or three when round 1 has an odd count, or one alone)."""


@dataclass(frozen=True)
class GroupResult:
    """Outcome of one test on ``nodes``; ``detail`` says what failed, for people."""

    nodes: Group
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class RepairPlan:
    """Round 2: ``waves`` of tests to run one wave after another; the tests of one wave
    share no node, so they can run at the same time.

    Each test pairs a suspect with a cleared node (or, when no node is cleared, with a
    suspect from a different round-1 test). ``unresolved`` are suspects that no test
    can separate (no partner available).
    """

    suspects: tuple[str, ...]
    waves: tuple[tuple[Group, ...], ...]
    unresolved: tuple[str, ...]

    @property
    def tests(self) -> tuple[Group, ...]:
        return tuple(group for wave in self.waves for group in wave)


@dataclass(frozen=True)
class Diagnosis:
    """``bad``: nodes that failed a test whose other members are cleared; ``cleared``:
    nodes that passed a test; ``unresolved``: nodes in failed tests that are neither."""

    bad: tuple[str, ...]
    cleared: tuple[str, ...]
    unresolved: tuple[str, ...]


def _unique(nodes: Sequence[str], what: str) -> list[str]:
    seen: set[str] = set()
    for node in nodes:
        if not node:
            raise InvalidArgument(f"{what}: empty node name")
        if node in seen:
            raise InvalidArgument(f"{what}: node {node!r} listed twice")
        seen.add(node)
    return list(nodes)


def pair_nodes(nodes: Sequence[str]) -> list[Group]:
    """Round 1: node ``i`` with node ``i + ceil(n/2)`` of the list.

    Pairing across the halves puts nodes that are adjacent in the list (usually on the
    same leaf switch) in different pairs, so the tests cross the fabric. With an odd
    count the middle node joins the last pair (a group of three); a single node is
    tested alone (its matmul only).
    """
    nodes = _unique(nodes, "pair_nodes")
    if len(nodes) <= 1:
        return [tuple(nodes)] if nodes else []
    half = (len(nodes) + 1) // 2
    groups: list[Group] = [(nodes[i], nodes[i + half]) for i in range(len(nodes) - half)]
    if len(nodes) % 2:
        groups[-1] = (*groups[-1], nodes[half - 1])
    return groups


def _cleared(results: Iterable[GroupResult]) -> set[str]:
    return {node for r in results if r.ok for node in r.nodes}


def repair_suspects(results: Sequence[GroupResult], healthy: Sequence[str] = ()) -> RepairPlan:
    """Round 2: pair each member of a failed round-1 test with a cleared node.

    Cleared nodes are the members of passing tests plus ``healthy`` (e.g. spare nodes
    known to be good). When suspects outnumber cleared nodes, cleared nodes are reused
    over several waves. Without any cleared node, suspects are paired across different
    failed tests (A-B and C-D failed: test A-C and B-D), which still separates them when
    only some are bad.
    """
    cleared = sorted(_cleared(results) | set(_unique(healthy, "healthy")))
    suspects: list[str] = []
    origin: dict[str, int] = {}
    for index, result in enumerate(results):
        if result.ok:
            continue
        for node in result.nodes:
            if node not in cleared and node not in origin:
                origin[node] = index
                suspects.append(node)
    if not suspects:
        return RepairPlan((), (), ())
    waves: list[tuple[Group, ...]] = []
    unresolved: list[str] = []
    if cleared:
        for start in range(0, len(suspects), len(cleared)):
            batch = suspects[start : start + len(cleared)]
            waves.append(tuple((suspect, partner) for suspect, partner in zip(batch, cleared, strict=False)))
    else:
        pending = list(suspects)
        wave: list[Group] = []
        while pending:
            node = pending.pop(0)
            partner = next((p for p in pending if origin[p] != origin[node]), None)
            if partner is None:
                unresolved.append(node)
                continue
            pending.remove(partner)
            wave.append((node, partner))
        if wave:
            waves.append(tuple(wave))
    return RepairPlan(tuple(suspects), tuple(waves), tuple(unresolved))


def diagnose(results: Iterable[GroupResult]) -> Diagnosis:
    """Name the bad nodes from the results of all rounds (see module doc for the rule)."""
    results = list(results)
    cleared = _cleared(results)
    bad = {
        node
        for r in results
        if not r.ok
        for node in r.nodes
        if node not in cleared and all(other in cleared for other in r.nodes if other != node)
    }
    involved = {node for r in results if not r.ok for node in r.nodes}
    unresolved = involved - cleared - bad
    return Diagnosis(tuple(sorted(bad)), tuple(sorted(cleared)), tuple(sorted(unresolved)))
