"""A silent agent whose heartbeat key is fresh is not lost: its beats wait in the events
stream that unicornd reads late (found by scripts/bench/scale.py: from 1,024 nodes the
backlog made live agents look silent, and their tasks were restarted)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from detect.classify import load_classifier
from detect.liveness import Expired
from detect.rootcause import Evidence
from plan.hardware import gpu_spec
from plan.objective import FailureModel
from tests.unicornd.coord_world import render, task, world
from unicorn_core import protocol
from unicorn_core.config import AgentConfig, Config, DetectConfig
from unicorn_core.keys import RedisKeys
from unicorn_core.protocol import Heartbeat
from unicornd import oob
from unicornd.core import Core
from unicornd.detector import Detector, JobEvidence
from unicornd.inputs import AgentInputs
from unicornd.replan import PlanContext
from unicornd.state import Policy
from unicornd.store import Store

CTX = PlanContext(gpu_spec("a100-80g"), FailureModel(24.0), lambda _gpn, _gen: render)
CFG = replace(Config(), ssh=replace(Config().ssh, enabled=False))
"""No SSH probe: the silence is decided at once (with the probe, after it)."""


def silence(job_id: int, node: str, epoch: int = 0) -> JobEvidence:
    """A silence finding as :meth:`Detector.check` makes it (``epoch``: the agent's then)."""
    c = Expired(job_id, node, last_beat_s=0.0, silent_s=9.0, timeout_s=1.5).classification()
    return JobEvidence(job_id, Evidence(node, None, time.monotonic(), c, "heartbeat"), agent_epoch=epoch)


async def test_a_fresh_heartbeat_key_spares_the_agent_and_a_stale_one_does_not(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    cfg = CFG
    keys = RedisKeys(cfg.redis.key_prefix)
    core = Core(Store(client, keys, Policy()), CTX)
    agents = AgentInputs(cfg, core, Detector(DetectConfig(), AgentConfig(), load_classifier(None)))
    try:
        await core.start(world(2, [task("a", 1, ["n1", "n2"])]))

        async def beat(age_s: float) -> None:
            hb = Heartbeat(
                job_id=1,
                node="n2",
                wall_time_s=time.time() - age_s,
                agent_pid=7,
                pids=[8],
                iteration=3,
                seq=1,
            )
            await client.set(keys.heartbeat(1, "n2"), protocol.encode(hb))

        await beat(0.2)
        await agents.on_finding(silence(1, "n2"), finding_id="hb-1")
        assert core.snap.open_incident("a") is None  # spared: nothing decided
        await beat(30.0)  # the key outlived its beats (or the agent's clock is far behind)
        await agents.on_finding(silence(1, "n2"), finding_id="hb-2")
        inc = core.snap.open_incident("a")
        assert inc is not None and inc.node == "n2" and inc.rule == "heartbeat_timeout", inc
    finally:
        await client.aclose()


async def test_no_heartbeat_key_lets_the_silence_stand(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    cfg = CFG
    core = Core(Store(client, RedisKeys(cfg.redis.key_prefix), Policy()), CTX)
    agents = AgentInputs(cfg, core, Detector(DetectConfig(), AgentConfig(), load_classifier(None)))
    try:
        await core.start(world(2, [task("a", 1, ["n1", "n2"])]))
        await agents.on_finding(silence(1, "n2"), finding_id="hb-1")
        inc = core.snap.open_incident("a")
        assert inc is not None and inc.node == "n2", inc
    finally:
        await client.aclose()


async def test_a_probe_verdict_about_an_agent_replaced_or_heard_meanwhile_is_dropped(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe finds no agent process (agent_lost, SEV2: restart the task's processes). That
    verdict stands only if nothing changed while the probe ran: an agent unicornd launched or
    stopped meanwhile, or a beat heard meanwhile, makes it about an agent that is gone or
    alive. A possible cause of stop 34's and 35's CI failures: a second incident restarting
    a task that had just resumed. A node that does not answer SSH is drained whatever happened."""
    client = aioredis.Redis.from_url(redis_url)
    cfg = replace(Config(), ssh=replace(Config().ssh, enabled=True))
    keys = RedisKeys(cfg.redis.key_prefix)
    core = Core(Store(client, keys, Policy()), CTX)
    detector = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    agents = AgentInputs(cfg, core, detector)
    during: list[Callable[[], Awaitable[None]]] = []
    reachable = True

    async def probe(_ssh: object, _agent: object, node: str, job_id: int) -> oob.ProbeResult:
        for act in during:
            await act()
        return oob.ProbeResult(node, job_id, reachable, "" if reachable else "timed out", answered=reachable)

    monkeypatch.setattr(oob, "probe_node", probe)

    async def beat() -> None:
        hb = Heartbeat(
            job_id=1, node="n2", wall_time_s=time.time(), agent_pid=7, pids=[8], iteration=3, seq=1
        )
        await client.set(keys.heartbeat(1, "n2"), protocol.encode(hb))

    async def relaunched() -> None:
        detector.expect_agent(1, "n2", time.monotonic())

    async def probed(finding_id: str) -> None:
        await client.delete(keys.heartbeat(1, "n2"))  # silent until the probe: it is probed
        await agents.on_finding(silence(1, "n2", detector.agent_epoch(1, "n2")), finding_id=finding_id)
        await asyncio.gather(*agents.probes.values())

    try:
        await core.start(world(2, [task("a", 1, ["n1", "n2"])]))
        detector.expect_agent(1, "n2", time.monotonic())
        for n, act in enumerate((beat, relaunched)):
            during[:] = [act]
            await probed(f"hb-{n}")
            assert core.snap.open_incident("a") is None, act.__name__
        during.clear()
        reachable = False  # no SSH answer: the node's fault, whatever the agent did
        during[:] = [relaunched]
        await probed("hb-ssh")
        inc = core.snap.open_incident("a")
        assert inc is not None and inc.rule == "ssh_unreachable", inc
    finally:
        await client.aclose()


async def test_a_probe_verdict_with_nothing_changed_meanwhile_stands(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    cfg = replace(Config(), ssh=replace(Config().ssh, enabled=True))
    core = Core(Store(client, RedisKeys(cfg.redis.key_prefix), Policy()), CTX)
    detector = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    agents = AgentInputs(cfg, core, detector)

    async def probe(_ssh: object, _agent: object, node: str, job_id: int) -> oob.ProbeResult:
        return oob.ProbeResult(node, job_id, True, answered=True)  # reachable, no agent process

    monkeypatch.setattr(oob, "probe_node", probe)
    try:
        await core.start(world(2, [task("a", 1, ["n1", "n2"])]))
        detector.expect_agent(1, "n2", time.monotonic())
        await agents.on_finding(silence(1, "n2", detector.agent_epoch(1, "n2")), finding_id="hb-1")
        await asyncio.gather(*agents.probes.values())
        inc = core.snap.open_incident("a")
        assert inc is not None and inc.node == "n2" and inc.rule == "agent_lost", inc
    finally:
        await client.aclose()


async def test_a_silence_whose_agent_is_relaunched_while_its_decision_waits_is_dropped(
    redis_url: str,
) -> None:
    """The epoch is compared again under the decision lock: a decision committed while this
    one waited (a replan's relaunch of that agent) makes the silence about an agent that is
    gone (review: before, only the probe compared it, and before it awaited Redis and the lock)."""
    client = aioredis.Redis.from_url(redis_url)
    core = Core(Store(client, RedisKeys(CFG.redis.key_prefix), Policy()), CTX)
    detector = Detector(DetectConfig(), AgentConfig(), load_classifier(None))
    agents = AgentInputs(CFG, core, detector)
    try:
        await core.start(world(2, [task("a", 1, ["n1", "n2"])]))
        detector.expect_agent(1, "n2", time.monotonic())
        found = silence(1, "n2", detector.agent_epoch(1, "n2"))
        async with core._lock:  # another decision is being committed
            deciding = asyncio.create_task(agents.on_finding(found, finding_id="hb-1"))
            await asyncio.sleep(0.05)
            assert not deciding.done()
            detector.expect_agent(1, "n2", time.monotonic())  # it relaunched the agent
        await deciding
        assert core.snap.open_incident("a") is None
        # The same silence of the current agent still stands.
        await agents.on_finding(silence(1, "n2", detector.agent_epoch(1, "n2")), finding_id="hb-2")
        inc = core.snap.open_incident("a")
        assert inc is not None and inc.node == "n2", inc
    finally:
        await client.aclose()


async def test_a_heartbeat_stamped_far_in_the_future_never_spares_a_silence(redis_url: str) -> None:
    """An agent clock ahead by more than the timeout makes its key's age meaningless."""
    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(CFG.redis.key_prefix)
    core = Core(Store(client, keys, Policy()), CTX)
    agents = AgentInputs(CFG, core, Detector(DetectConfig(), AgentConfig(), load_classifier(None)))
    try:
        await core.start(world(2, [task("a", 1, ["n1", "n2"])]))
        hb = Heartbeat(
            job_id=1, node="n2", wall_time_s=time.time() + 60, agent_pid=7, pids=[8], iteration=3, seq=1
        )
        await client.set(keys.heartbeat(1, "n2"), protocol.encode(hb))
        await agents.on_finding(silence(1, "n2"), finding_id="hb-1")
        inc = core.snap.open_incident("a")
        assert inc is not None and inc.node == "n2", inc
    finally:
        await client.aclose()
