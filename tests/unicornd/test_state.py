"""Coordinator state: transition tables walked pair by pair, record and action round trips."""

from __future__ import annotations

import ast
import enum
import itertools
import json
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from detect.statuses import ErrorStatus, Severity
from tests.unicornd.coord_world import MODEL, layout_for
from unicorn_core import protocol
from unicorn_core.errors import InvalidArgument, ProtocolError
from unicorn_core.protocol import AgentAction
from unicornd.actions import (
    ACTION_TYPES,
    CheckNode,
    CloseIncident,
    Decision,
    DrainNode,
    Grow,
    LaunchAgents,
    NodeArgv,
    NotifyOperator,
    Replan,
    Requeue,
    RestartAgent,
    ResumeNode,
    RollBack,
    SendCommand,
    Shrink,
    action_from_dict,
    action_to_dict,
)
from unicornd.state import (
    LADDER_TRANSITIONS,
    NODE_TRANSITIONS,
    TASK_TRANSITIONS,
    IllegalTransition,
    Incident,
    LadderStage,
    NodeHealth,
    NodeRecord,
    Policy,
    StageEntry,
    TaskRecord,
    TaskState,
    transition,
)

TABLES: list[tuple[type[enum.Enum], Mapping[enum.Enum, frozenset[enum.Enum]], enum.Enum]] = [
    (TaskState, TASK_TRANSITIONS, TaskState.PENDING),  # type: ignore[list-item]
    (NodeHealth, NODE_TRANSITIONS, NodeHealth.HEALTHY),  # type: ignore[list-item]
    (LadderStage, LADDER_TRANSITIONS, LadderStage.DETECTED),  # type: ignore[list-item]
]


@pytest.mark.parametrize(("cls", "table", "initial"), TABLES, ids=lambda v: getattr(v, "__name__", ""))
def test_every_pair_is_allowed_exactly_when_the_table_says(
    cls: type[enum.Enum], table: Mapping[enum.Enum, frozenset[enum.Enum]], initial: enum.Enum
) -> None:
    assert set(table) == set(cls), "the table covers every state"
    for old, new in itertools.product(cls, cls):
        if new in table[old]:
            assert transition(old, new) is new  # type: ignore[type-var]
        else:
            with pytest.raises(IllegalTransition) as info:
                transition(old, new)  # type: ignore[type-var]
            assert f"{old.value} -> {new.value}" in str(info.value)


@pytest.mark.parametrize(("cls", "table", "initial"), TABLES, ids=lambda v: getattr(v, "__name__", ""))
def test_every_state_is_reachable_from_the_initial_one(
    cls: type[enum.Enum], table: Mapping[enum.Enum, frozenset[enum.Enum]], initial: enum.Enum
) -> None:
    seen, frontier = {initial}, [initial]
    while frontier:
        for nxt in table[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(cls)


def test_terminal_states_and_the_ladder_shape() -> None:
    assert {s for s, nxt in TASK_TRANSITIONS.items() if not nxt} == {TaskState.FINISHED, TaskState.FAILED}
    assert not LADDER_TRANSITIONS[LadderStage.CLOSED]
    # Fig. 7: each rung can climb to the next one, and the final path leads to closed.
    path = [
        LadderStage.DETECTED,
        LadderStage.RETRY_IN_PLACE,
        LadderStage.RESTART_PROCESSES,
        LadderStage.ISOLATE,
        LadderStage.REPLAN,
        LadderStage.TRANSITION,
        LadderStage.RESUMED,
        LadderStage.CLOSED,
    ]
    for old, new in itertools.pairwise(path):
        assert transition(old, new) is new


def test_transition_between_different_machines_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="cannot move"):
        transition(TaskState.PENDING, NodeHealth.HEALTHY)  # type: ignore[type-var]


def test_with_state_keeps_the_record_on_illegal_moves() -> None:
    rec = TaskRecord("t1", "t1", MODEL, ("train",), state=TaskState.FINISHED)
    with pytest.raises(IllegalTransition):
        rec.with_state(TaskState.RUNNING)
    assert rec.state is TaskState.FINISHED
    assert rec.with_state(TaskState.FINISHED) is rec


# --- records -------------------------------------------------------------------------

names = st.from_regex(r"[a-z][a-z0-9_.-]{0,8}", fullmatch=True)
times = st.floats(min_value=0, max_value=2e9, allow_nan=False)


@st.composite
def task_records(draw: st.DrawFn) -> TaskRecord:
    nodes = draw(st.lists(names, unique=True, max_size=4))
    min_gpus = draw(st.integers(1, 16))
    return TaskRecord(
        task_id=draw(names),
        name=draw(names),
        model=MODEL,
        command=tuple(draw(st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=4))),
        weight=draw(st.floats(0.5, 2.0)),
        min_gpus=min_gpus,
        max_gpus=draw(st.none() | st.integers(min_gpus, 64)),
        job_id=draw(st.none() | st.integers(0, 2**31)),
        state=draw(st.sampled_from(TaskState)),
        layout=draw(st.none() | st.sampled_from([layout_for(1), layout_for(2), layout_for(4)])),
        nodes=tuple(nodes),
        last_iteration=draw(st.none() | st.integers(0, 10**9)),
        recoveries_without_progress=draw(st.integers(0, 9)),
        recovery_times_s=tuple(draw(st.lists(times, max_size=4))),
        resizes_this_run=draw(st.integers(0, 3)),
        incidents_opened=draw(st.integers(0, 99)),
        launched_s=draw(st.none() | times),
    )


@st.composite
def node_records(draw: st.DrawFn) -> NodeRecord:
    return NodeRecord(
        name=draw(names),
        health=draw(st.sampled_from(NodeHealth)),
        reason=draw(st.text(max_size=40)),
        failures_s=tuple(draw(st.lists(times, max_size=4))),
        drains_s=tuple(draw(st.lists(times, max_size=4))),
        held=draw(st.booleans()),
        joins=draw(st.integers(0, 50)),
    )


@st.composite
def incidents(draw: st.DrawFn) -> Incident:
    return Incident(
        incident_id=draw(names),
        task_id=draw(st.none() | names),
        node=draw(names),
        rank=draw(st.none() | st.integers(0, 1023)),
        status=draw(st.sampled_from(ErrorStatus)),
        severity=draw(st.sampled_from(Severity)),
        rule=draw(st.text(max_size=20)),
        evidence=draw(st.text(max_size=60)),
        opened_s=draw(times),
        stage=draw(st.sampled_from(LadderStage)),
        attempts=draw(st.dictionaries(st.sampled_from(LadderStage), st.integers(0, 5), max_size=3)),
        timeline=tuple(
            StageEntry(s, t)
            for s, t in draw(st.lists(st.tuples(st.sampled_from(LadderStage), times), max_size=5))
        ),
        last_action_s=draw(times),
        finding_ids=tuple(draw(st.lists(st.text(min_size=1, max_size=12), max_size=4))),
        isolated_nodes=tuple(draw(st.lists(names, max_size=3))),
        pending_drain=draw(st.none() | names),
        note=draw(st.text(max_size=30)),
    )


@given(st.one_of(task_records(), node_records(), incidents()))
def test_records_round_trip_through_json(record: TaskRecord | NodeRecord | Incident) -> None:
    data = record.to_dict()
    assert json.loads(json.dumps(data)) == data, "plain JSON types only"
    assert type(record).from_dict(json.loads(json.dumps(data))) == record


@pytest.mark.parametrize(
    ("patch", "error", "match"),
    [
        ({"weight": 3.0}, InvalidArgument, "weight"),
        ({"weight": "heavy"}, ProtocolError, r"\$\.weight"),
        ({"state": "sleeping"}, ProtocolError, "Invalid enum value 'sleeping'"),
        ({"nodes": ["n1", "n1"]}, InvalidArgument, "distinct"),
        ({"nodes": ["bad node"]}, InvalidArgument, "must match"),
        ({"min_gpus": 0}, InvalidArgument, "min_gpus"),
        ({"max_gpus": 1, "min_gpus": 4}, InvalidArgument, "max_gpus"),
        ({"command": []}, InvalidArgument, "command"),
        ({"model": {"layers": 4}}, ProtocolError, "missing required field"),
        ({"layout": {"tp": 0, "pp": 1, "dp": 1, "micro_batch": 1, "global_batch": 1}}, InvalidArgument, "tp"),
        ({"colour": "blue"}, ProtocolError, "unknown field.*colour.*valid: task_id"),
        ({"last_iteration": -1}, InvalidArgument, "last_iteration"),
        ({"recovery_times_s": [1.0, float("inf")]}, InvalidArgument, "finite"),
    ],
)
def test_bad_task_data_is_rejected_with_a_clear_message(
    patch: dict[str, object], error: type[Exception], match: str
) -> None:
    good = TaskRecord("t1", "t1", MODEL, ("train",), nodes=("n1",), layout=layout_for(1)).to_dict()
    with pytest.raises(error, match=match):
        TaskRecord.from_dict({**good, **patch})


@pytest.mark.parametrize(
    ("cls", "data", "match"),
    [
        (NodeRecord, [], "expected an object"),
        (NodeRecord, {"name": "n1", "health": "zombie"}, "Invalid enum value"),
        (NodeRecord, {"health": "healthy"}, "missing required field `name`"),
        (NodeRecord, {"name": "n1", "joins": -1}, "joins"),
        (Incident, {"incident_id": "i", "node": "n1"}, "missing required field"),
    ],
)
def test_bad_node_and_incident_data(cls: type[NodeRecord | Incident], data: object, match: str) -> None:
    with pytest.raises((ProtocolError, InvalidArgument), match=match):
        cls.from_dict(data)


def test_incident_attempts_round_trip_with_stage_keys() -> None:
    inc = Incident(
        "a.1", "a", "n1", 3, ErrorStatus.ECC_ERROR, Severity.SEV1, "r", "e", 5.0,
        attempts={LadderStage.ISOLATE: 2}, timeline=(StageEntry(LadderStage.DETECTED, 5.0),),
    )  # fmt: skip
    data = inc.to_dict()
    assert data["attempts"] == {"isolate": 2}
    assert data["timeline"] == [{"stage": "detected", "t_s": 5.0, "detail": ""}]
    assert Incident.from_dict(data) == inc


def test_policy_rejects_nonsense_and_computes_the_drain_limit() -> None:
    with pytest.raises(InvalidArgument, match="max_drain_fraction"):
        Policy(max_drain_fraction=1.5)
    with pytest.raises(InvalidArgument, match="settle_s"):
        Policy(settle_s=-1)
    with pytest.raises(InvalidArgument, match="command_deadline_s"):
        Policy(command_deadline_s=0)
    pol = Policy(max_drain_fraction=0.25, min_drains_per_window=1)
    assert [pol.drain_limit(n) for n in (1, 4, 8, 24)] == [1, 1, 2, 6]


# --- actions -------------------------------------------------------------------------

ALL_ACTIONS = [
    DrainNode("i/isolate/1/drain/n1", "n1", "unicorn: ecc_error i"),
    ResumeNode("join/n1/2/resume", "n1", "unicorn: resumed by operator"),
    CheckNode("join/n1/2/check", "n1"),
    SendCommand("i/restart/1/restart_ranks/n1", 7, "n1", AgentAction.RESTART_RANKS, 120.0),
    SendCommand("p/relaunch/n1", 7, "n1", AgentAction.RELAUNCH, 120.0, ("torchrun", "x"), {"A": "1"}),
    LaunchAgents("p/launch", "t", 7, (NodeArgv("n2", ("torchrun", "y")),), {"B": "2"}),
    RestartAgent("i/restart_processes/1/restart_agent/n2", "t", 7, "n2"),
    RollBack("i/restart_processes/1/rollback/n2", "t", 7, "n2"),
    Shrink("p/shrink", "t", 7, ("n1",)),
    Grow("p/grow", "t", 7, ("n2", "n3")),
    Requeue("p/requeue", "t", 7, ()),
    Replan("i/replan", "why"),
    NotifyOperator("i/notify", None, "why"),
    CloseIncident("i/close", "i"),
]


def test_every_action_kind_is_listed_and_round_trips() -> None:
    assert {type(a) for a in ALL_ACTIONS} == set(ACTION_TYPES.values())
    for action in ALL_ACTIONS:
        data = json.loads(json.dumps(action_to_dict(action)))
        assert data["kind"] == action.kind
        assert action_from_dict(data) == action


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        ({"kind": "explode", "action_id": "x"}, "unknown_type"),
        ({"kind": "drain_node", "action_id": "x"}, "invalid"),
        ({"kind": "shrink", "action_id": "x", "task_id": "t", "job_id": "7", "nodes": []}, "invalid"),
        ("drain", "invalid"),
    ],
)
def test_bad_action_data_raises_protocol_error(data: object, kind: str) -> None:
    with pytest.raises(ProtocolError) as info:
        action_from_dict(data)
    assert info.value.kind == kind


def test_send_command_becomes_a_valid_wire_message_with_its_id() -> None:
    cmd = ALL_ACTIONS[4]
    assert isinstance(cmd, SendCommand)
    msg = protocol.decode(protocol.encode(cmd.message(1234.5)))
    assert isinstance(msg, protocol.AgentCommand)
    assert (msg.command_id, msg.action, msg.argv, msg.env) == (
        cmd.action_id,
        AgentAction.RELAUNCH,
        ["torchrun", "x"],
        {"A": "1"},
    )


def test_decision_refuses_duplicate_action_ids() -> None:
    with pytest.raises(InvalidArgument, match="duplicate"):
        Decision(actions=(Replan("same", "a"), Replan("same", "b")))
    assert Decision().empty


_PURE = [
    "state",
    "actions",
    "replan",
    "calibrate",
    *(f"decide/{p.stem}" for p in (Path(__file__).parents[2] / "unicornd" / "decide").glob("*.py")),
]


@pytest.mark.parametrize("module", _PURE)
def test_decision_modules_do_no_io_and_read_no_clock(module: str) -> None:
    """Decisions are functions of (snapshot, input, clock): no I/O module is even imported."""
    source = (Path(__file__).parents[2] / "unicornd" / f"{module}.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    forbidden = {
        "time",
        "asyncio",
        "redis",
        "subprocess",
        "socket",
        "os",
        "asyncssh",
        "torch",
        "random",
        "datetime",
    }
    assert not imported & forbidden
