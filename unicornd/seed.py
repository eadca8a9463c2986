"""What a starting leader knows of its agents' silence: seeded from their heartbeat keys.

A unicornd that takes over (after a crash, or a standby after a failover) has read none of
its agents' heartbeats. Without a seed, every agent would get a new agent's grace
(``initial_timeout_s``, 30 s) before its silence counts, so a node that died before or
during the takeover would be noticed 30 s late. Each agent sets its heartbeat key with every
beat (``RedisKeys.heartbeat``; it expires ``agent.heartbeat_ttl_s`` after the last one), so
the key says how long the agent has been silent:

* key present: silent since the beat it holds (its wall time; a clock ahead of ours counts
  as 0);
* key absent, and the task settled: running, no incident open (no agent restart or
  relaunch under way), launched longer than ``initial_timeout_s`` ago and its ranks
  reported an iteration since (:meth:`~unicornd.state.TaskRecord.starting` false, whatever
  the iteration's number: a relaunch from a checkpoint iterates below the old mark), so its
  agents have beaten and the key would be there if they still did: silent at least
  ``heartbeat_ttl_s``;
* otherwise (key absent while the task may be starting agents, or unreadable): no seed,
  the new agent's grace stands.

:func:`silences` is pure; the daemon reads the keys and feeds the result to
:meth:`unicornd.detector.Detector.seed_silence`. A seeded silence only starts the usual path:
the heartbeat check (a fresh key spares it) and out-of-band confirmation before any drain.
"""

from __future__ import annotations

from collections.abc import Mapping

from unicorn_core import protocol
from unicorn_core.protocol import Heartbeat
from unicornd.state import LIVE_TASK_STATES, Snapshot, TaskState

Agent = tuple[int, str]
"""(job id, node)."""


def decode_beat(raw: bytes | str, agent: Agent) -> Heartbeat | None:
    """The heartbeat a key holds for ``agent`` (None: another message, or another agent's);
    raises :class:`~unicorn_core.errors.ProtocolError` when it does not decode."""
    msg = protocol.decode(raw.encode() if isinstance(raw, str) else raw)
    if not isinstance(msg, Heartbeat) or (msg.job_id, msg.node) != agent:
        return None
    return msg


def expected_agents(snap: Snapshot) -> list[Agent]:
    """The agents a starting leader expects (as ``Detector.expect_running``): the nodes of
    every live task with a job that is not being requeued, less those that finished."""
    out = []
    for task in snap.tasks.values():
        if task.state in LIVE_TASK_STATES and task.job_id is not None and task.requeue is None:
            out += [(task.job_id, n) for n in task.nodes if n not in task.finished_nodes]
    return out


def silences(
    snap: Snapshot,
    beats: Mapping[Agent, Heartbeat | None],
    now_wall_s: float,
    initial_timeout_s: float,
    heartbeat_ttl_s: float,
) -> dict[Agent, float]:
    """Seconds each expected agent has been silent, for those the keys tell (module doc).

    ``beats``: the decoded heartbeat key of each agent, None when it is absent; an agent
    missing from ``beats`` (unreadable) gets no seed. A beat naming another job or node is
    ignored (no seed)."""
    settled = {
        t.job_id
        for t in snap.tasks.values()
        if t.job_id is not None
        and t.state is TaskState.RUNNING
        and snap.open_incident(t.task_id) is None
        and t.launched_s is not None
        and now_wall_s - t.launched_s > initial_timeout_s
        and not t.starting()
    }
    out: dict[Agent, float] = {}
    for agent in expected_agents(snap):
        if agent not in beats:
            continue
        beat = beats[agent]
        if beat is not None:
            if (beat.job_id, beat.node) == agent:
                out[agent] = max(0.0, now_wall_s - beat.wall_time_s)
            continue
        if agent[0] in settled:
            out[agent] = heartbeat_ttl_s
    return out
