"""Redis key names: exact names, validation of components, no collisions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unicorn_core.errors import InvalidArgument
from unicorn_core.keys import COORDINATOR_GROUP, RedisKeys, check_name


def test_default_names() -> None:
    keys = RedisKeys()
    assert keys.events(42) == "unicorn:events:42"
    assert keys.agent_commands(42, "gpu-a01") == "unicorn:cmd:42:gpu-a01"
    assert keys.agent_launch(42, "gpu-a01") == "unicorn:cmd:42:gpu-a01:launch"
    assert keys.command_results(42) == "unicorn:cmd-results:42"
    assert keys.heartbeat(42, "node.12") == "unicorn:hb:42:node.12"
    assert keys.daemon_liveness() == "unicorn:unicornd:alive"
    assert keys.incidents() == "unicorn:incidents"
    assert keys.actions_done() == "unicorn:actions:done"
    assert keys.actions_done_at() == "unicorn:actions:done_at"
    assert keys.state() == "unicorn:state"
    assert keys.actions_pending() == "unicorn:actions:pending"
    assert keys.control() == "unicorn:control"
    assert keys.operator_control() == "unicorn:ops"
    assert keys.reply(keys.control(), "17-0") == "unicorn:control:reply:17-0"
    assert keys.reply(keys.operator_control(), "17-3") == "unicorn:ops:reply:17-3"
    assert keys.agent_password(42) == "unicorn:secret:agent:42"
    assert keys.job_env(42) == "unicorn:env:42"
    assert COORDINATOR_GROUP == "unicornd"


def test_prefix_applies_to_every_key() -> None:
    keys = RedisKeys("test-7.a")
    assert keys.events(3) == "test-7.a:events:3"
    assert keys.heartbeat(0, "n1") == "test-7.a:hb:0:n1"


def test_is_frozen() -> None:
    keys = RedisKeys()
    with pytest.raises(dataclasses.FrozenInstanceError):
        keys.prefix = "other"  # type: ignore[misc]


BAD_NAMES = ["", "a:b", "a b", "a/b", "a\n", "\n", "ü", "a*", "{a}", "a\x00"]


@pytest.mark.parametrize("bad", BAD_NAMES, ids=repr)
def test_invalid_components_are_rejected_and_quoted(bad: str) -> None:
    keys = RedisKeys()
    calls: list[Callable[[], object]] = [
        lambda: RedisKeys(bad),
        lambda: keys.agent_commands(1, bad),
        lambda: keys.heartbeat(1, bad),
        lambda: check_name(bad),
        lambda: check_name(bad, "task id"),
    ]
    for call in calls:
        with pytest.raises(InvalidArgument) as info:
            call()
        assert repr(bad) in str(info.value)


@pytest.mark.parametrize("job_id", [-1, True, "1", 1.0])
def test_invalid_job_ids_are_rejected(job_id: object) -> None:
    keys = RedisKeys()
    with pytest.raises(InvalidArgument, match="job id"):
        keys.heartbeat(job_id, "n1")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="job id"):
        keys.agent_commands(job_id, "n1")  # type: ignore[arg-type]


def test_non_string_components_are_rejected() -> None:
    with pytest.raises(InvalidArgument):
        check_name(12)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        RedisKeys().heartbeat(1, 12)  # type: ignore[arg-type]


def test_check_name_returns_valid_names_and_says_what_was_wrong() -> None:
    assert check_name("gpu-a01") == "gpu-a01" and check_name("t_1.x", "task id") == "t_1.x"
    with pytest.raises(InvalidArgument, match=r"invalid task id 'a:b'"):
        check_name("a:b", "task id")


names = st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True)
job_ids = st.integers(min_value=0, max_value=10**12)

# (method, arguments) -> key, over every method of RedisKeys.
calls = st.one_of(
    st.tuples(
        st.sampled_from(
            [
                "daemon_liveness",
                "incidents",
                "actions_done",
                "actions_done_at",
                "state",
                "state_meta",
                "goodput",
                "actions_pending",
                "control",
                "operator_control",
                "leader",
                "fence",
                "commits",
                "standbys",
            ]
        ),
        st.just(()),
    ),
    st.tuples(st.just("standby"), st.tuples(names)),
    st.tuples(st.just("state_records"), st.tuples(st.sampled_from(["tasks", "nodes", "incidents"]))),
    st.tuples(
        st.sampled_from(["events", "command_results", "agent_password", "job_env"]), st.tuples(job_ids)
    ),
    st.tuples(st.sampled_from(["agent_commands", "agent_launch", "heartbeat"]), st.tuples(job_ids, names)),
)


def key_for(prefix: str, call: tuple[str, tuple[object, ...]]) -> str:
    method, args = call
    result = getattr(RedisKeys(prefix), method)(*args)
    assert isinstance(result, str)
    return result


def test_calls_strategy_covers_every_method() -> None:
    methods = {name for name in vars(RedisKeys) if not name.startswith("_")}
    covered = {
        "events",
        "command_results",
        "daemon_liveness",
        "incidents",
        "actions_done",
        "actions_done_at",
        "state",
        "state_meta",
        "state_records",
        "goodput",
        "actions_pending",
        "control",
        "operator_control",
        "agent_password",
        "job_env",
        "reply",
        "agent_commands",
        "agent_launch",
        "heartbeat",
        "leader",
        "fence",
        "commits",
        "standby",
        "standbys",
    }
    assert methods - {"prefix"} == covered


@given(names, calls, names, calls)
def test_distinct_inputs_give_distinct_keys(
    prefix_a: str,
    call_a: tuple[str, tuple[object, ...]],
    prefix_b: str,
    call_b: tuple[str, tuple[object, ...]],
) -> None:
    same_input = (prefix_a, call_a) == (prefix_b, call_b)
    assert (key_for(prefix_a, call_a) == key_for(prefix_b, call_b)) == same_input


@given(names, calls)
def test_keys_start_with_the_prefix(prefix: str, call: tuple[str, tuple[object, ...]]) -> None:
    assert key_for(prefix, call).startswith(prefix + ":")


def test_distinct_keys_over_a_grid_of_look_alike_inputs() -> None:
    prefixes = ["unicorn", "unicorn.cmd", "u-hb", "1"]
    job_ids_ = [0, 1, 11]
    parts = ["1", "11", "1.1", "a", "results", "alive", "done", "current", "events", "cmd", "tasks"]
    inputs: list[tuple[str, tuple[str, tuple[object, ...]]]] = []
    for prefix in prefixes:
        inputs += [
            (prefix, (method, ()))
            for method in [
                "daemon_liveness",
                "incidents",
                "actions_done",
                "actions_done_at",
                "state",
                "state_meta",
                "goodput",
                "actions_pending",
                "control",
                "operator_control",
            ]
        ]
        inputs += [(prefix, ("state_records", (kind,))) for kind in ("tasks", "nodes", "incidents")]
        inputs += [
            (prefix, (method, (job_id,)))
            for method in ["events", "command_results", "agent_password", "job_env"]
            for job_id in job_ids_
        ]
        inputs += [
            (prefix, (method, (job_id, part)))
            for method in ["agent_commands", "agent_launch", "heartbeat"]
            for job_id in job_ids_
            for part in parts
        ]
    produced = {key_for(prefix, call) for prefix, call in inputs}
    assert len(produced) == len(inputs)


def test_state_records_only_for_the_snapshots_kinds() -> None:
    assert RedisKeys("u").state_records("nodes") == "u:state:nodes"
    with pytest.raises(InvalidArgument, match="unknown kind"):
        RedisKeys("u").state_records("meta")


def test_reply_keys_only_for_control_streams_and_entry_ids() -> None:
    keys = RedisKeys()
    with pytest.raises(InvalidArgument, match="control streams"):
        keys.reply(keys.state(), "1-0")
    for bad in ["", "1", "1-x", "1-0:x", "*"]:
        with pytest.raises(InvalidArgument, match="entry id"):
            keys.reply(keys.control(), bad)
