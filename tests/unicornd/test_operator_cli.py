"""Operator mutations (``unicornctl drain/resume/incidents confirm``) and ``plan --what-if-fail``.

Three layers: the pure decision and the what-if outlook on coord_world snapshots; the
operator check; the commands against a real redis-server, with unicornd down and with a
real :class:`unicornd.daemon.Daemon` running against the shared fake Slurm
(:class:`tests.fakes.slurm.FakeSlurm`), so a request really goes through the control
stream, the decision is persisted and the executor calls Slurm.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
import redis
import redis.asyncio as aioredis
from click.testing import CliRunner

from detect.statuses import ErrorStatus
from tests.fakes.slurm import FakeSlurm
from tests.unicornd.coord_world import apply, finding, of_kind, task, world
from tests.unicornd.redis_world import until
from unicorn_core import acl, redis_io
from unicorn_core.config import Config, load_config
from unicorn_core.errors import InvalidArgument
from unicorn_core.keys import PAYLOAD_FIELD, RedisKeys
from unicorn_core.logs import reset_logging
from unicornd.actions import DrainNode, Replan, ResumeNode
from unicornd.cli import (
    EXIT_NO_DAEMON,
    EXIT_NOT_CONFIRMED,
    EXIT_NOT_OPERATOR,
    EXIT_UNKNOWN_INCIDENT,
    EXIT_UNKNOWN_NODE,
    Caller,
    cli,
    operator_refusal,
    outlook_json,
    slurm_user_from_config,
    what_if_fail,
)
from unicornd.control import (
    ConfirmDrain,
    ControlClient,
    Drain,
    InvalidRequest,
    Register,
    Reply,
    RequestRefused,
    decode_request,
    encode_reply,
    encode_request,
)
from unicornd.daemon import Daemon
from unicornd.decide import on_finding, on_node_join, on_operator_drain
from unicornd.state import NodeHealth, Snapshot, TaskState
from unicornd.store import read_snapshot, snapshot_to_json

T0 = 1_700_000_000.0
UNICORNCTL = Path(sys.executable).parent / "unicornctl"
PREFIX = "optest"


def two_tasks() -> Snapshot:
    """n1..n4: task a on n1,n2 (weight 2), task b on n3, n4 spare."""
    return world(4, [task("a", 1, ["n1", "n2"], weight=2.0), task("b", 2, ["n3"])])


# --- the pure decision --------------------------------------------------------------------


def test_operator_drain_takes_the_node_out_holds_it_and_replans() -> None:
    snap = two_tasks()
    d = on_operator_drain(snap, "n2", "fan  failing\n", T0)
    (drain,) = of_kind(d.actions, DrainNode)
    assert isinstance(drain, DrainNode) and drain.node == "n2"
    assert drain.reason == "unicorn: operator: fan failing"
    assert of_kind(d.actions, Replan)
    after = apply(snap, d)
    rec = after.nodes["n2"]
    assert rec.health is NodeHealth.DRAINING and rec.held and rec.reason == drain.reason
    assert rec.drains_s == ()  # not counted against the drain limiter
    # Slurm resumed outside unicorn: a held node is drained again; only the operator's resume frees it.
    drained = rec.with_health(NodeHealth.DRAINED)
    after = after.apply(nodes=[drained])
    assert of_kind(on_node_join(after, "n2", T0 + 60).actions, DrainNode)
    freed = on_node_join(after, "n2", T0 + 60, by_operator=True)
    assert of_kind(freed.actions, ResumeNode) and not apply(after, freed).nodes["n2"].held


def test_operator_drain_of_a_node_already_out_only_holds_and_relabels() -> None:
    snap = two_tasks()
    out = replace(snap.nodes["n4"].with_health(NodeHealth.DRAINING).with_health(NodeHealth.DRAINED))
    snap = snap.apply(nodes=[out])
    d = on_operator_drain(snap, "n4", "bad DIMM", T0)
    assert [a.kind for a in d.actions] == ["drain_node"]  # new reason in Slurm, no replan
    after = apply(snap, d)
    assert after.nodes["n4"].held and after.nodes["n4"].reason == "unicorn: operator: bad DIMM"
    again = on_operator_drain(after, "n4", "bad DIMM", T0 + 1)
    assert again.empty and again.notes


def test_operator_drain_of_a_hostlist_drains_each_node_with_one_reason_and_replans_once() -> None:
    """A rack (``n[2-4]``): one decision, the drains adjacent with one reason (the executor
    sends them to Slurm in one call), one replan; a node of it already out is relabelled."""
    snap = two_tasks()
    out = snap.nodes["n4"].with_health(NodeHealth.DRAINING).with_health(NodeHealth.DRAINED)
    snap = snap.apply(nodes=[out])
    d = on_operator_drain(snap, "n[2-4]", "rack 7 power", T0)
    assert [a.kind for a in d.actions] == ["drain_node", "drain_node", "drain_node", "replan"]
    drains = [a for a in d.actions if isinstance(a, DrainNode)]
    assert [a.node for a in drains] == ["n2", "n3", "n4"]
    assert {a.reason for a in drains} == {"unicorn: operator: rack 7 power"}
    after = apply(snap, d)
    assert all(after.nodes[n].held for n in ("n2", "n3", "n4"))
    assert after.nodes["n2"].health is NodeHealth.DRAINING and after.nodes["n4"].health is NodeHealth.DRAINED
    assert on_operator_drain(after, "n[2-4]", "rack 7 power", T0 + 1).actions == ()  # nothing new


@pytest.mark.parametrize(
    ("node", "reason", "message"),
    [("n9", "x", "unknown node"), ("n1", "  ", "reason"), ("n[3-9]", "x", "unknown node 'n\\[5-9\\]'")],
)
def test_operator_drain_refuses_bad_input(node: str, reason: str, message: str) -> None:
    snap = two_tasks()
    with pytest.raises(InvalidArgument, match=message):
        on_operator_drain(snap, node, reason, T0)


# --- what-if: the decision and the daemon's planner call, applied to nothing -----------------


def test_what_if_fail_moves_the_task_off_the_node_and_applies_nothing() -> None:
    snap = two_tasks()
    before = snapshot_to_json(snap)
    seen = what_if_fail(snap, "n2", Config(), T0)
    assert snapshot_to_json(snap) == before
    assert [a.node for a in seen.decision.actions if isinstance(a, DrainNode)] == ["n2"]
    assert seen.plan is not None and seen.transition is not None
    doc = outlook_json(seen)
    assert doc["replan"] and doc["plan"]["healthy_nodes"] == 3
    nodes = {t["task_id"]: t["nodes"] for t in doc["plan"]["tasks"]}
    assert "n2" not in {n for ns in nodes.values() for n in ns}
    assert doc["plan"]["generation"] == snap.plan_generation + 1
    assert doc["actions"] and json.loads(json.dumps(doc)) == doc


def test_what_if_fail_of_a_spare_node_drains_it_without_moving_tasks() -> None:
    seen = what_if_fail(two_tasks(), "n4", Config(), T0)
    doc = outlook_json(seen)
    assert [a["node"] for a in doc["decision"]["actions"] if a["kind"] == "drain_node"] == ["n4"]
    assert doc["plan"]["healthy_nodes"] == 3
    assert all("n4" not in t["nodes"] for t in doc["plan"]["tasks"])


def test_plan_keeps_its_offline_mode_and_what_if_takes_only_json() -> None:
    tasks = str(Path(__file__).parents[2] / "etc" / "tasks" / "gpt3-1.3b.toml")
    offline = CliRunner().invoke(
        cli, ["plan", "--tasks", tasks, "--nodes", "2", "--json"], env={"UNICORN_CONFIG": ""}
    )
    assert offline.exit_code == 0, offline.output
    assert json.loads(offline.stdout)["nodes"] == 2
    mixed = CliRunner().invoke(
        cli, ["plan", "--what-if-fail", "n1", "--nodes", "2"], env={"UNICORN_CONFIG": ""}
    )
    assert mixed.exit_code == 2 and "takes only --json" in mixed.stderr


def test_what_if_fail_of_an_unknown_node_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="unknown node 'n9'"):
        what_if_fail(two_tasks(), "n9", Config(), T0)


# --- who is an operator ---------------------------------------------------------------------


def test_slurm_user_is_read_from_scontrol_show_config() -> None:
    text = "Configuration data as of ...\nSlurmctldPort = 6817\nSlurmUser               = slurm(64030)\n"
    assert slurm_user_from_config(text) == "slurm"
    with pytest.raises(InvalidArgument, match="SlurmUser"):
        slurm_user_from_config("SlurmdUser = root(0)\n")


def _never() -> str:
    raise AssertionError("the SlurmUser must not be looked up")


def _fails() -> str:
    raise InvalidArgument("scontrol: cannot reach slurmctld")


def test_operator_check() -> None:
    group = grp.getgrgid(os.getegid())
    member = Caller(uid=4242, user="alice", gids=frozenset({group.gr_gid}))
    stranger = Caller(uid=4243, user="bob", gids=frozenset({987_654}))
    assert operator_refusal(Caller(0, "root", frozenset({0})), "", _never) is None
    assert operator_refusal(member, group.gr_name, _never) is None
    assert operator_refusal(Caller(64030, "slurm", frozenset()), "", lambda: "slurm") is None
    why = operator_refusal(stranger, group.gr_name, lambda: "slurm")
    assert why is not None and "bob is not an operator" in why and group.gr_name in why
    why = operator_refusal(stranger, "", _fails)
    assert why is not None and "SlurmUser is unknown" in why
    why = operator_refusal(stranger, "no-such-group-xyz", lambda: "slurm")
    assert why is not None and "does not exist" in why


# --- the commands against a real Redis ------------------------------------------------------


def _env(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNICORN_", "SLURM_"))}
    return {
        **env,
        "UNICORN_REDIS__URL": url,
        "UNICORN_REDIS__KEY_PREFIX": PREFIX,
        "UNICORN_CONFIG": "",
        "UNICORN_SLURM__CONF": "/nonexistent/slurm.conf",
        **extra,
    }


def ctl(url: str, *args: str, prefix: Sequence[str] = (), **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, str(UNICORNCTL), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(url, **extra),
        check=False,
    )


def test_with_unicornd_down_mutations_fail_clearly_and_change_nothing(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.set(RedisKeys(PREFIX).state(), snapshot_to_json(two_tasks()))
    if os.geteuid() == 0:
        for args in (("drain", "n1", "--reason", "x", "--yes"), ("resume", "n1", "--yes")):
            res = ctl(redis_url, *args)
            assert res.returncode == EXIT_NO_DAEMON, res.stderr
            assert "unicornd is not running" in res.stderr and "nothing changed" in res.stderr
    assert r.xlen(RedisKeys(PREFIX).control()) == 0


def invoke_full(url: str, caller: Caller, *args: str, **extra: str) -> tuple[int, str, str]:
    """unicornctl in this process, as ``caller`` (the group passes it down in ``obj``):
    exit code, stdout, stderr."""
    try:
        result = CliRunner().invoke(cli, list(args), env=_env(url, **extra), obj={"caller": caller})
    finally:
        reset_logging()
    return result.exit_code, result.stdout, result.stderr


def invoke(url: str, caller: Caller, *args: str, **extra: str) -> tuple[int, str]:
    code, _out, err = invoke_full(url, caller, *args, **extra)
    return code, err


def test_non_operators_are_refused(redis_url: str, tmp_path: Path) -> None:
    bob = Caller(uid=4243, user="bob", gids=frozenset({987_654}))
    no_slurm = str(tmp_path)  # no scontrol here: the SlurmUser cannot be learnt, so bob is refused
    code, err = invoke(
        redis_url, bob, "drain", "n1", "--reason", "x", "--yes", UNICORN_SLURM__BIN_DIR=no_slurm
    )
    assert code == EXIT_NOT_OPERATOR, err
    assert "bob is not root" in err and "SlurmUser is unknown" in err and "nothing changed" in err
    # A member of slurm.operators_group passes the check (and then finds unicornd down).
    staff = grp.getgrgid(os.getegid())
    alice = Caller(uid=4242, user="alice", gids=frozenset({staff.gr_gid}))
    code, err = invoke(
        redis_url, alice, "resume", "n1", "--yes", UNICORN_SLURM__OPERATORS_GROUP=staff.gr_name
    )
    assert code == EXIT_NO_DAEMON, err
    assert redis.Redis.from_url(redis_url).xlen(RedisKeys(PREFIX).control()) == 0


def held_back() -> Snapshot:
    """b.1 waits for an operator: the drain limiter (1 drain on 4 nodes) held n3's drain back."""
    snap = world(4, [task("a", 1, ["n1", "n2"]), task("b", 2, ["n3", "n4"])])
    snap = apply(snap, on_finding(snap, finding("f1", 1, "n1", ErrorStatus.ECC_ERROR), T0))
    snap = apply(snap, on_finding(snap, finding("f2", 2, "n3", ErrorStatus.GPU_DRIVER_ERROR), T0 + 5))
    assert snap.incidents["b.1"].pending_drain == "n3"
    return snap


ROOT = Caller(uid=0, user="root", gids=frozenset({0}))


def _answer(url: str, replies: list[bytes], stop: threading.Event) -> None:
    """A stand-in unicornd: takes each request of the operators' stream, says yes."""
    r = redis.Redis.from_url(url)
    keys = RedisKeys(PREFIX)
    last = "0-0"
    while not stop.is_set():
        for _stream, entries in r.xread({keys.operator_control(): last}, block=100) or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                replies.append(fields[PAYLOAD_FIELD.encode()])
                r.set(keys.reply(keys.operator_control(), last), encode_reply(Reply(ok=True)))


def test_incidents_confirm_answers_the_drain_limiter_for_operators_only(
    redis_url: str, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = RedisKeys(PREFIX)
    r.set(keys.state(), snapshot_to_json(held_back()))
    r.set(keys.daemon_liveness(), b"1")  # unicornd "alive"; nobody answers yet
    bob = Caller(uid=4243, user="bob", gids=frozenset({987_654}))
    code, err = invoke(
        redis_url, bob, "incidents", "confirm", "b.1", "--yes", UNICORN_SLURM__BIN_DIR=str(tmp_path)
    )
    assert code == EXIT_NOT_OPERATOR and "bob is not root" in err and "nothing changed" in err, err
    # Without --yes: the incident, what confirming does, and nothing sent.
    code, out, err = invoke_full(redis_url, ROOT, "incidents", "confirm", "b.1")
    assert code == EXIT_NOT_CONFIRMED and "--yes" in err, err
    assert "b.1  open" in out and "confirming drains n3" in out, out
    assert "unicornctl incidents confirm b.1 would:" in out and "drain_node node=n3" in out, out
    # Unknown incidents, and one that waits for no drain: clear errors, nothing sent.
    code, err = invoke(redis_url, ROOT, "incidents", "confirm", "zz.9", "--yes")
    assert code == EXIT_UNKNOWN_INCIDENT and "unknown incident 'zz.9'" in err and "b.1" in err, err
    code, err = invoke(redis_url, ROOT, "incidents", "confirm", "a.1", "--yes")
    assert code == EXIT_UNKNOWN_INCIDENT and "no drain waiting" in err, err
    assert r.xlen(keys.operator_control()) == 0 and r.xlen(keys.control()) == 0
    # The list still works beside the subcommand; its options do not mix with it.
    code, out, err = invoke_full(redis_url, ROOT, "incidents", "--json")
    assert code == 0 and [d["incident_id"] for d in json.loads(out)] == ["a.1", "b.1"], err
    code, err = invoke(redis_url, ROOT, "incidents", "--json", "confirm", "b.1")
    assert code == 2 and "takes neither" in err, err
    # With --yes: one ConfirmDrain on the operators' stream, and unicornd's yes.
    replies: list[bytes] = []
    stop = threading.Event()
    answering = threading.Thread(target=_answer, args=(redis_url, replies, stop), daemon=True)
    answering.start()
    try:
        code, out, err = invoke_full(redis_url, ROOT, "incidents", "confirm", "b.1", "--yes")
    finally:
        stop.set()
        answering.join(10)
    assert code == 0 and "unicornd accepted: confirm the drain of incident b.1" in out, err
    assert [decode_request(p) for p in replies] == [ConfirmDrain(incident="b.1")]
    assert r.xlen(keys.control()) == 0


async def _ctl(url: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(UNICORNCTL),
        *args,
        env=_env(url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return cast(int, proc.returncode), out.decode(), err.decode()


@pytest.mark.skipif(os.geteuid() != 0, reason="the caller must be an operator (root) here")
async def test_drain_and_resume_go_through_a_live_unicornd(redis_url: str) -> None:
    # unicornd runs as the Redis user scripts/install tells administrators to create.
    admin = aioredis.Redis.from_url(redis_url)
    await acl.set_user(admin, "unicornd", acl.coordinator_rules(RedisKeys(PREFIX), "coord-pw"))
    await admin.aclose()
    cfg = load_config(
        None,
        env={
            "UNICORN_REDIS__URL": acl.url_with_user(redis_url, "unicornd", "coord-pw"),
            "UNICORN_REDIS__KEY_PREFIX": PREFIX,
        },
    )
    slurm = FakeSlurm(["n1", "n2", "n3", "n4"])
    client = redis_io.connect(cfg.redis, client_name="test-unicornd")
    daemon = Daemon(cfg, slurm, client)
    running = asyncio.create_task(daemon.run())
    keys = RedisKeys(PREFIX)
    try:
        await until(lambda: daemon.snapshot is not None)
        code, out, err = await _ctl(redis_url, "drain", "n2", "--reason", "fan failing")
        assert code == EXIT_NOT_CONFIRMED, err
        assert "drain_node node=n2 reason='unicorn: operator: fan failing'" in out and "--yes" in err
        assert not slurm.calls
        code, out, err = await _ctl(redis_url, "drain", "n7", "--reason", "x", "--yes")
        assert code == EXIT_UNKNOWN_NODE and "unknown node 'n7'" in err
        # A drain sent on the users' stream (a client bypassing unicornctl) is refused by
        # unicornd itself: only the operators' stream, which Redis lets only operators
        # write, carries drains.
        control = ControlClient(client, keys, timeout_s=10)
        with pytest.raises(RequestRefused, match="operator's request"):
            await control.send_payload(encode_request(Drain(node="n2", reason="x")), operator=False)
        assert not slurm.calls and daemon.snap.nodes["n2"].health is NodeHealth.HEALTHY
        # A registration whose job environment is malformed cannot be built; sent anyway
        # (a malformed payload), unicornd refuses it and nothing changes.
        pending = replace(two_tasks().tasks["a"], state=TaskState.PENDING, nodes=(), layout=None)
        bad = {"cwd": "rel", "env": {}}
        with pytest.raises(InvalidRequest, match="absolute path"):
            Register(task=pending.to_dict(), credential="MUNGE:x", environment=bad)
        raw = {"op": "register", "task": pending.to_dict(), "credential": "MUNGE:x", "environment": bad}
        with pytest.raises(RequestRefused, match="absolute path"):
            await control.send_payload(json.dumps(raw).encode())
        assert "a" not in daemon.snap.tasks and not await client.exists(keys.job_env(pending.job_id or 0))

        code, out, err = await _ctl(redis_url, "drain", "n2", "--reason", "fan failing", "--yes")
        assert code == 0, err
        await until(lambda: daemon.snap.nodes["n2"].health is NodeHealth.DRAINED)
        assert slurm.calls == [("drain", "n2", "unicorn: operator: fan failing")]
        persisted = await read_snapshot(client, keys, daemon.store.policy)
        assert persisted is not None and persisted.nodes["n2"].held

        code, out, err = await _ctl(redis_url, "plan", "--what-if-fail", "n1", "--json")
        assert code == 0, err
        assert json.loads(out)["node"] == "n1"

        code, out, err = await _ctl(redis_url, "resume", "n2", "--yes")
        assert code == 0, err
        await until(lambda: daemon.snap.nodes["n2"].health is NodeHealth.HEALTHY)
        assert [c[:2] for c in slurm.calls[1:]] == [("resume", "n2"), ("run_on_nodes", ("n2",))]
        assert not daemon.snap.nodes["n2"].held

        # A rack: one request, one decision, its drains in one Slurm call.
        before = len(slurm.calls)
        code, out, err = await _ctl(redis_url, "drain", "n[3-4]", "--reason", "rack 7", "--yes")
        assert code == 0, err
        await until(lambda: all(daemon.snap.nodes[n].health is NodeHealth.DRAINED for n in ("n3", "n4")))
        assert slurm.calls[before:] == [("drain_nodes", ("n3", "n4"), "unicorn: operator: rack 7")]
    finally:
        daemon._stop.set()
        assert await asyncio.wait_for(running, 30) == 0
        await client.aclose()
