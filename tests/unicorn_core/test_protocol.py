"""Wire protocol: round trips, and every bad input rejected as a ProtocolError of the right kind."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from unicorn_core.errors import ProtocolError
from unicorn_core.protocol import (
    MAX_MESSAGE_BYTES,
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    AgentAction,
    AgentCommand,
    CommandResult,
    ExceptionReport,
    FaultReport,
    GpuFaultKind,
    GpuHealthEvent,
    Heartbeat,
    IterationPhase,
    IterationTiming,
    Message,
    ProcessExit,
    SafeDecoder,
    SlowStep,
    decode,
    encode,
)

KINDS = {"malformed", "unknown_version", "unknown_type", "invalid", "too_large"}

# --- strategies ------------------------------------------------------------------------

u63 = st.integers(min_value=0, max_value=2**63 - 1)
pos_int = st.integers(min_value=1, max_value=2**31 - 1)
opt_index = st.none() | u63
nonneg_float = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
finite_float = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(max_size=50)
nonempty = st.text(min_size=1, max_size=30)

envelope: dict[str, st.SearchStrategy[Any]] = {
    "job_id": u63,
    "node": nonempty,
    "wall_time_s": nonneg_float,
}


@st.composite
def process_exits(draw: st.DrawFn) -> ProcessExit:
    exit_code, signal = draw(
        st.sampled_from(["code", "signal", "none"]).flatmap(
            lambda which: st.tuples(
                st.integers(0, 255) if which == "code" else st.none(),
                st.integers(1, 64) if which == "signal" else st.none(),
            )
        )
    )
    return draw(
        st.builds(
            ProcessExit,
            rank=opt_index,
            local_rank=opt_index,
            pid=pos_int,
            exit_code=st.just(exit_code),
            signal=st.just(signal),
            error_file_text=st.none() | text,
            stderr_tail=text,
            **envelope,
        )
    )


@st.composite
def agent_commands(draw: st.DrawFn) -> AgentCommand:
    action = draw(st.sampled_from(AgentAction))
    argv = draw(st.lists(text, max_size=5)) if action is AgentAction.RELAUNCH else []
    return draw(
        st.builds(
            AgentCommand,
            command_id=nonempty,
            action=st.just(action),
            argv=st.just(argv),
            env=st.dictionaries(text, text, max_size=5),
            deadline_s=st.floats(min_value=1e-3, max_value=1e6),
            **envelope,
        )
    )


STRATEGIES: dict[type[Message], st.SearchStrategy[Any]] = {
    Heartbeat: st.builds(
        Heartbeat,
        agent_pid=pos_int,
        pids=st.lists(pos_int, max_size=8),
        iteration=opt_index,
        seq=u63,
        **envelope,
    ),
    ProcessExit: process_exits(),
    ExceptionReport: st.builds(
        ExceptionReport, rank=opt_index, exc_type=nonempty, message=text, traceback=text, **envelope
    ),
    IterationTiming: st.builds(
        IterationTiming,
        rank=u63,
        iteration=u63,
        duration_s=nonneg_float,
        samples=st.none() | u63,
        phase=st.sampled_from(IterationPhase),
        loss=st.none() | finite_float,
        **envelope,
    ),
    SlowStep: st.builds(
        SlowStep,
        rank=u63,
        iteration=u63,
        phase=st.sampled_from([IterationPhase.CHECKPOINT, IterationPhase.EVAL]),
        **envelope,
    ),
    FaultReport: st.builds(
        FaultReport,
        status=nonempty,
        severity=st.sampled_from(["SEV1", "SEV2", "SEV3"]),
        rule=text,
        rank=opt_index,
        evidence=text,
        **envelope,
    ),
    GpuHealthEvent: st.builds(
        GpuHealthEvent,
        gpu_index=st.integers(0, 64),
        kind=st.sampled_from(GpuFaultKind),
        value=finite_float,
        detail=text,
        injected=st.booleans(),
        **envelope,
    ),
    AgentCommand: agent_commands(),
    CommandResult: st.builds(CommandResult, command_id=nonempty, ok=st.booleans(), detail=text, **envelope),
}

messages = st.one_of(*STRATEGIES.values())

ENV = {"v": SCHEMA_VERSION, "job_id": 7, "node": "gpu-a01", "wall_time_s": 1.7e9}
HEARTBEAT = {"type": "hb", **ENV, "agent_pid": 100, "pids": [101, 102], "iteration": 5, "seq": 3}


def raw(obj: object) -> bytes:
    """Encode an arbitrary object, bypassing the schema."""
    return msgspec.msgpack.encode(obj)


def kind_of(data: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert info.value.kind in KINDS
    return info.value.kind


# --- round trips and wire format ----------------------------------------------------------


def test_every_message_type_has_a_strategy() -> None:
    assert set(STRATEGIES) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
def test_round_trip(cls: type[Message]) -> None:
    @given(STRATEGIES[cls])
    def check(msg: Message) -> None:
        assert type(msg) is cls
        assert decode(encode(msg)) == msg

    check()


def test_wire_tags_are_stable() -> None:
    tags = {cls.__name__: cls.__struct_config__.tag for cls in MESSAGE_TYPES}
    assert tags == {
        "Heartbeat": "hb",
        "ProcessExit": "exit",
        "ExceptionReport": "exc",
        "IterationTiming": "iter",
        "GpuHealthEvent": "gpu",
        "FaultReport": "fault",
        "SlowStep": "slow",
        "AgentCommand": "cmd",
        "CommandResult": "result",
    }


def test_wire_format_is_a_plain_msgpack_map() -> None:
    msg = GpuHealthEvent(
        job_id=3,
        node="n1",
        wall_time_s=2.5,
        gpu_index=1,
        kind=GpuFaultKind.XID,
        value=79,
        detail="",
        injected=True,
    )
    assert msgspec.msgpack.decode(encode(msg)) == {
        "type": "gpu",
        "v": 1,
        "job_id": 3,
        "node": "n1",
        "wall_time_s": 2.5,
        "gpu_index": 1,
        "kind": "xid",
        "value": 79,
        "detail": "",
        "injected": True,
    }


def test_decodes_hand_built_map() -> None:
    assert decode(raw(HEARTBEAT)) == Heartbeat(
        job_id=7, node="gpu-a01", wall_time_s=1.7e9, agent_pid=100, pids=[101, 102], iteration=5, seq=3
    )


def test_unknown_fields_are_ignored_for_additive_evolution() -> None:
    msg = decode(raw({**HEARTBEAT, "added_in_a_later_release": [1, 2]}))
    assert isinstance(msg, Heartbeat)


def test_iteration_timing_microbatch_fields_are_additive() -> None:
    """``microbatches``/``recomputed_microbatches`` (issue 23 item 4) default to None: a sender
    of the previous release still decodes, and the fields round-trip when set."""
    old = {"type": "iter", **ENV, "rank": 0, "iteration": 5, "duration_s": 0.5, "samples": 12}
    msg = decode(raw(old))
    assert isinstance(msg, IterationTiming)
    assert (msg.microbatches, msg.recomputed_microbatches) == (None, None)
    new = decode(raw({**old, "microbatches": 12, "recomputed_microbatches": 3}))
    assert isinstance(new, IterationTiming)
    assert (new.microbatches, new.recomputed_microbatches) == (12, 3)
    assert decode(encode(new)) == new
    with pytest.raises(ProtocolError, match="exceeds microbatches"):
        decode(raw({**old, "microbatches": 12, "recomputed_microbatches": 13}))


def test_iteration_timing_compute_and_stage_are_additive() -> None:
    """``compute_s``/``stage`` (issue 17 item 5, stragglers) default to None: a sender of the
    previous release still decodes, the fields round-trip, and bad values are refused."""
    old = {"type": "iter", **ENV, "rank": 0, "iteration": 5, "duration_s": 0.5, "samples": 12}
    msg = decode(raw(old))
    assert isinstance(msg, IterationTiming)
    assert (msg.compute_s, msg.stage) == (None, None)
    new = decode(raw({**old, "compute_s": 0.25, "stage": 1}))
    assert isinstance(new, IterationTiming)
    assert (new.compute_s, new.stage) == (0.25, 1)
    assert decode(encode(new)) == new
    for bad in ({"compute_s": -0.1}, {"compute_s": float("nan")}, {"stage": -1}):
        with pytest.raises(ProtocolError, match="invalid"):
            decode(raw({**old, **bad}))


def test_agent_command_defaults_to_no_argv_and_env() -> None:
    data = {"type": "cmd", **ENV, "command_id": "c1", "action": "stop", "deadline_s": 30.0}
    msg = decode(raw(data))
    assert isinstance(msg, AgentCommand)
    assert (msg.action, msg.argv, msg.env) == (AgentAction.STOP, [], {})


# --- bad input: only ProtocolError, of the right kind --------------------------------------


@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError as exc:
        assert exc.kind in KINDS


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)


@given(
    st.fixed_dictionaries({}, optional={"type": st.sampled_from(["hb", "cmd", "zz"]), "v": st.integers(0, 3)})
)
def test_arbitrary_envelopes_raise_only_protocol_error(base: dict[str, object]) -> None:
    try:
        decode(raw({**base, "job_id": 1, "node": "n1"}))
    except ProtocolError as exc:
        assert exc.kind in KINDS


@given(st.dictionaries(st.sampled_from([*HEARTBEAT, "x"]), msgpack_values, max_size=10))
def test_arbitrary_maps_raise_only_protocol_error(fields: dict[str, object]) -> None:
    try:
        decode(raw({**HEARTBEAT, **fields}))
    except ProtocolError as exc:
        assert exc.kind in KINDS


@given(messages, st.data())
def test_corrupted_encoding_raises_only_protocol_error(msg: Message, data: st.DataObject) -> None:
    encoded = bytearray(encode(msg))
    index = data.draw(st.integers(0, len(encoded) - 1))
    encoded[index] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(encoded))
    except ProtocolError as exc:
        assert exc.kind in KINDS


@given(messages)
def test_every_strict_prefix_is_rejected(msg: Message) -> None:
    encoded = encode(msg)
    for end in range(len(encoded)):
        assert kind_of(encoded[:end]) in {"malformed", "invalid"}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", "malformed"),
        (b"\xc1", "malformed"),  # never used in msgpack
        (raw(HEARTBEAT) + b"\x00", "malformed"),  # trailing bytes
        (raw([HEARTBEAT]), "malformed"),
        (raw("hb"), "malformed"),
        (raw(None), "malformed"),
        (b"\x91" * 100_000, "malformed"),  # nesting deeper than the decoder's recursion limit
        (b"\xd6\xff" + b"\xff" * 4, "malformed"),  # msgpack timestamp extension
    ],
)
def test_malformed(data: bytes, expected: str) -> None:
    assert kind_of(data) == expected


@pytest.mark.parametrize(
    "data",
    [
        {**HEARTBEAT, "v": 2},
        {**HEARTBEAT, "v": 0},
        {**HEARTBEAT, "v": -1},
        {"type": "hb", "v": 2},  # version is checked before fields
        {**HEARTBEAT, "v": 2, "pids": "not a list"},
        {**HEARTBEAT, "v": 2, "type": "new-in-v2"},
    ],
)
def test_unknown_version(data: dict[str, object]) -> None:
    assert kind_of(raw(data)) == "unknown_version"


@pytest.mark.parametrize("tag", ["nope", "", "HB", "heartbeat"])
def test_unknown_type(tag: str) -> None:
    assert kind_of(raw({**HEARTBEAT, "type": tag})) == "unknown_type"


@pytest.mark.parametrize(
    "changes",
    [
        {"pid": "123"},
        {"agent_pid": "100"},
        {"pids": [1, "2"]},
        {"pids": 3},
        {"job_id": 1.5},
        {"job_id": True},
        {"node": 5},
        {"iteration": "5"},
        {"seq": None},
        {"wall_time_s": "now"},
        {"type": 1},
        {"v": "1"},
        {"v": 1.0},
        {"v": None},
    ],
    ids=repr,
)
def test_wrong_typed_field_is_invalid(changes: dict[str, object]) -> None:
    data = {**HEARTBEAT, **changes}
    if "pid" in changes:  # a field of another message type
        data = {"type": "exit", **ENV, "rank": 0, "local_rank": 0, "exit_code": 1, "signal": None}
        data |= {"error_file_text": None, "stderr_tail": "", **changes}
    assert kind_of(raw(data)) == "invalid"


@pytest.mark.parametrize("field", ["v", "type", "job_id", "node", "wall_time_s", "agent_pid", "pids", "seq"])
def test_missing_field_is_invalid(field: str) -> None:
    data = {key: value for key, value in HEARTBEAT.items() if key != field}
    assert kind_of(raw(data)) == "invalid"


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({**HEARTBEAT, "job_id": -1}, "job_id"),
        ({**HEARTBEAT, "node": ""}, "node"),
        ({**HEARTBEAT, "wall_time_s": float("nan")}, "wall_time_s"),
        ({**HEARTBEAT, "wall_time_s": -1.0}, "wall_time_s"),
        ({**HEARTBEAT, "pids": [1, 0]}, "pids"),
        ({**HEARTBEAT, "agent_pid": 0}, "agent_pid"),
        ({**HEARTBEAT, "iteration": -1}, "iteration"),
        (
            {"type": "iter", **ENV, "rank": 0, "iteration": 1, "duration_s": float("inf"), "samples": None},
            "duration_s",
        ),
        (
            {"type": "iter", **ENV, "rank": 0, "iteration": 1, "duration_s": -0.5, "samples": None},
            "duration_s",
        ),
        ({"type": "iter", **ENV, "rank": -1, "iteration": 1, "duration_s": 0.5, "samples": None}, "rank"),
        (
            {
                "type": "gpu",
                **ENV,
                "gpu_index": -1,
                "kind": "xid",
                "value": 1,
                "detail": "",
                "injected": False,
            },
            "gpu_index",
        ),
        (
            {
                "type": "gpu",
                **ENV,
                "gpu_index": 0,
                "kind": "melted",
                "value": 1,
                "detail": "",
                "injected": False,
            },
            "kind",
        ),
        ({"type": "result", **ENV, "command_id": "", "ok": True, "detail": ""}, "command_id"),
        ({"type": "cmd", **ENV, "command_id": "c", "action": "stop", "deadline_s": 0.0}, "deadline_s"),
        (
            {"type": "cmd", **ENV, "command_id": "c", "action": "stop", "argv": ["x"], "deadline_s": 5.0},
            "argv",
        ),
        ({"type": "cmd", **ENV, "command_id": "c", "action": "explode", "deadline_s": 5.0}, "action"),
        ({"type": "exc", **ENV, "rank": 0, "exc_type": "", "message": "", "traceback": ""}, "exc_type"),
    ],
)
def test_bad_value_is_invalid(data: dict[str, object], problem: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(raw(data))
    assert info.value.kind == "invalid"
    assert problem in info.value.detail


@pytest.mark.parametrize(
    ("exit_code", "signal"),
    [(1, 9), (-9, None), (256, None), (None, 0)],
)
def test_process_exit_status_rules(exit_code: int | None, signal: int | None) -> None:
    fields: dict[str, Any] = {
        "rank": 0,
        "local_rank": 0,
        "pid": 42,
        "error_file_text": None,
        "stderr_tail": "",
    }
    fields |= {"exit_code": exit_code, "signal": signal}
    with pytest.raises(ValueError):
        ProcessExit(job_id=1, node="n1", wall_time_s=0.0, **fields)
    assert kind_of(raw({"type": "exit", **ENV, **fields})) == "invalid"


def test_constructing_invalid_message_raises_value_error() -> None:
    with pytest.raises(ValueError, match="node"):
        CommandResult(job_id=1, node="", wall_time_s=0.0, command_id="c", ok=True, detail="")
    with pytest.raises(ValueError, match="version"):
        CommandResult(v=2, job_id=1, node="n", wall_time_s=0.0, command_id="c", ok=True, detail="")


def test_too_large() -> None:
    assert kind_of(b"\x00" * (MAX_MESSAGE_BYTES + 1)) == "too_large"
    big = raw({**HEARTBEAT, "padding": "x" * MAX_MESSAGE_BYTES})
    assert kind_of(big) == "too_large"


def test_encode_refuses_too_large_and_unencodable() -> None:
    common: dict[str, Any] = {"job_id": 1, "node": "n1", "wall_time_s": 0.0, "rank": None, "exc_type": "E"}
    with pytest.raises(ProtocolError) as info:
        encode(ExceptionReport(message="", traceback="x" * MAX_MESSAGE_BYTES, **common))
    assert info.value.kind == "too_large"
    with pytest.raises(ProtocolError) as info:
        encode(ExceptionReport(message="\udcff", traceback="", **common))  # lone surrogate
    assert info.value.kind == "invalid"
    just_fits = ExceptionReport(message="", traceback="x" * (MAX_MESSAGE_BYTES - 200), **common)
    assert decode(encode(just_fits)) == just_fits


# --- SafeDecoder ---------------------------------------------------------------------------


def test_safe_decoder_counts_by_kind() -> None:
    decoder = SafeDecoder()
    good = raw(HEARTBEAT)
    inputs = [
        good,
        b"",
        b"\xc1",
        raw({**HEARTBEAT, "v": 9}),
        raw({**HEARTBEAT, "type": "zz"}),
        raw({**HEARTBEAT, "seq": "x"}),
        b"\x00" * (MAX_MESSAGE_BYTES + 1),
        good,
    ]
    results = [decoder.decode(data) for data in inputs]
    assert [result is not None for result in results] == [
        True,
        False,
        False,
        False,
        False,
        False,
        False,
        True,
    ]
    assert decoder.decoded == 2
    assert decoder.failures == {
        "malformed": 2,
        "unknown_version": 1,
        "unknown_type": 1,
        "invalid": 1,
        "too_large": 1,
    }
    assert decoder.last_error is not None
    assert decoder.last_error.kind == "too_large"


def test_safe_decoders_are_independent() -> None:
    first, second = SafeDecoder(), SafeDecoder()
    first.decode(b"")
    assert first.failures["malformed"] == 1
    assert second.failures == {}
    assert second.last_error is None


@given(st.binary(max_size=256) | messages.map(encode))
def test_safe_decoder_never_raises(data: bytes) -> None:
    decoder = SafeDecoder()
    result = decoder.decode(data)
    assert decoder.decoded + sum(decoder.failures.values()) == 1
    assert (result is None) == (decoder.decoded == 0)
