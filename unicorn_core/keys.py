"""Every Redis key and stream name unicorn uses, in one place.

Keys are ``<prefix>:<kind>[:<component>...]``; components never contain ``:``, so no
two distinct calls produce the same name. Stream entries carry one encoded
:mod:`unicorn_core.protocol` message under the field :data:`PAYLOAD_FIELD`.

=============================  ===========  ====================  ==========================
Key                            Redis type   Written by            Read by
=============================  ===========  ====================  ==========================
``events(job)``                stream       the job's agents      unicornd (group
                                                                  :data:`COORDINATOR_GROUP`)
``agent_commands(job, node)``  stream       unicornd              the agent of job on node
``command_results(job)``       stream       the job's agents      tests, operators
``heartbeat(job, node)``       string, TTL  the agent (SET EX)    unicornd (expiry = lost)
``daemon_liveness()``          string, TTL  unicornd (SET EX)     ``unicornctl --check``
``incidents()``                stream       unicornd              CLI
``actions_done_at()``          sorted set   unicornd executor     unicornd executor
``actions_done()``             set          (before 2026-11-29)   unicornd (moved at start)
``state()``                    string       unicornd              unicornd, CLI
``goodput()``                  string       unicornd              unicornd, CLI
``actions_pending()``          list         unicornd              unicornd executor
``control()``                  stream       CLI, sbatch wrapper   unicornd (group)
``operator_control()``         stream       operators' CLI        unicornd (group)
``reply(stream, entry)``       string, TTL  unicornd              the requester
``agent_password(job)``        string       unicornd              unicornd
``job_env(job)``               string       unicornd              the agents of job
=============================  ===========  ====================  ==========================

``events(job)`` carries Heartbeat, ProcessExit, ExceptionReport, IterationTiming,
GpuHealthEvent and FaultReport; ``agent_commands`` carries AgentCommand; ``command_results`` carries
CommandResult. ``actions_done_at`` holds the ids of executed actions scored by when they
ran, so a restarted executor never repeats one; ids older than a week are dropped (the
set grew without end before: ``actions_done``, whose ids unicornd moves over at start).
``state`` is the coordinator's whole snapshot (tasks, nodes, incidents, plan generation)
as one JSON document, written in the same transaction as ``actions_pending`` (the
actions decided but not yet executed), so a restarted unicornd resumes exactly where it
was. ``control`` carries users' requests to unicornd (register or stop a task) as JSON,
``operator_control`` operators' requests (drain, resume, and users' requests too).

Streams an agent writes are per Slurm job, so a Redis ACL user per job
(:mod:`unicorn_core.acl`) can confine a job's agents to their own keys: one job cannot
write another job's events nor read its commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from unicorn_core.errors import InvalidArgument

COORDINATOR_GROUP: Final = "unicornd"
"""Consumer group through which unicornd reads ``events()`` and ``command_results()``."""

PAYLOAD_FIELD: Final = "msg"
"""Stream entry field that holds the encoded protocol message."""

_COMPONENT: Final = re.compile(r"[A-Za-z0-9_.-]+")


def _component(what: str, value: str) -> str:
    if not isinstance(value, str) or _COMPONENT.fullmatch(value) is None:
        raise InvalidArgument(f"invalid {what} {value!r}: must match [A-Za-z0-9_.-]+")
    return value


def check_name(value: str, what: str = "name") -> str:
    """``value`` when it can be a key component (a Slurm node name, a task id:
    ``[A-Za-z0-9_.-]+``); InvalidArgument quoting it, as ``what``, otherwise."""
    return _component(what, value)


def _job_id(job_id: int) -> str:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 0:
        raise InvalidArgument(f"invalid job id {job_id!r}: must be an int >= 0")
    return str(job_id)


@dataclass(frozen=True)
class RedisKeys:
    """Key names under ``prefix`` (one prefix per unicorn installation sharing a Redis).

    Raises InvalidArgument for a prefix or node name outside ``[A-Za-z0-9_.-]+``
    (Slurm names such as ``n1``, ``gpu-a01``, ``node.12`` pass; see :func:`check_name`)
    and for a negative job id.
    """

    prefix: str = "unicorn"

    def __post_init__(self) -> None:
        _component("prefix", self.prefix)

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def events(self, job_id: int) -> str:
        """Stream: the agents of ``job_id`` -> coordinator (all messages but command results)."""
        return self._key("events", _job_id(job_id))

    def agent_commands(self, job_id: int, node: str) -> str:
        """Stream: coordinator -> the agent of ``job_id`` on ``node``."""
        return self._key("cmd", _job_id(job_id), _component("node", node))

    def agent_launch(self, job_id: int, node: str) -> str:
        """String: the training command of the agent of ``job_id`` on ``node`` that one srun
        step for the whole job started (an :class:`~unicorn_core.protocol.AgentCommand`
        ``relaunch`` whose id is that agent's launch id). Beside, not in, the command stream:
        an agent it replaces never reads it."""
        return self._key("cmd", _job_id(job_id), _component("node", node), "launch")

    def command_results(self, job_id: int) -> str:
        """Stream: the agents of ``job_id`` -> coordinator, one CommandResult per AgentCommand."""
        return self._key("cmd-results", _job_id(job_id))

    def heartbeat(self, job_id: int, node: str) -> str:
        """String with TTL: present while the agent of ``job_id`` on ``node`` is alive."""
        return self._key("hb", _job_id(job_id), _component("node", node))

    def daemon_liveness(self) -> str:
        """String with TTL: present while a leading unicornd is alive."""
        return self._key("unicornd", "alive")

    def leader(self) -> str:
        """String with TTL (the lease): ``<token>:<id>`` of the leading unicornd."""
        return self._key("unicornd", "leader")

    def fence(self) -> str:
        """Counter: the newest fencing token granted; a commit with an older one is refused."""
        return self._key("unicornd", "fence")

    def commits(self) -> str:
        """Hash: token -> how many commits the leader holding that token made (written by
        the commit itself, so it counts exactly the accepted ones: a stale token's count
        that grows after a newer token committed is a fencing failure, which the soak bench
        looks for)."""
        return self._key("unicornd", "commits")

    def standby(self, ident: str) -> str:
        """String with TTL: a unicornd waiting to take over (its id, host and pid)."""
        return self._key("unicornd", "standby", _component("standby id", ident))

    def standbys(self) -> str:
        """Pattern of every :meth:`standby` key (for SCAN)."""
        return self._key("unicornd", "standby", "*")

    def incidents(self) -> str:
        """Stream: incident log written by unicornd."""
        return self._key("incidents")

    def actions_done(self) -> str:
        """Set: ids of actions executed before the ids were timed (read at start and moved
        to :meth:`actions_done_at`; never written)."""
        return self._key("actions", "done")

    def actions_done_at(self) -> str:
        """Sorted set: ids of actions already executed, scored by when (idempotency)."""
        return self._key("actions", "done_at")

    def state(self) -> str:
        """String: unicornd's snapshot as one JSON document (version 2, written before
        :meth:`state_meta`; read once and replaced by the hashes at the next commit)."""
        return self._key("state")

    def state_meta(self) -> str:
        """String: the snapshot's scalars as JSON (version, GPUs per node, plan generation,
        calibration); its presence says the records are in :meth:`state_records`."""
        return self._key("state", "meta")

    def state_records(self, kind: str) -> str:
        """Hash: the snapshot's records of ``kind`` (``tasks``, ``nodes``, ``incidents``),
        key -> JSON, so a commit writes only the records it changed."""
        if kind not in ("tasks", "nodes", "incidents"):
            raise InvalidArgument(f"state_records: unknown kind {kind!r}")
        return self._key("state", kind)

    def goodput(self) -> str:
        """String: unicornd's goodput ledger as JSON (:mod:`unicornd.goodput`), written by the
        leader after its commits; read by ``unicornctl goodput``."""
        return self._key("goodput")

    def actions_pending(self) -> str:
        """List: actions decided and persisted but not yet executed, in order (JSON each)."""
        return self._key("actions", "pending")

    def control(self) -> str:
        """Stream: users' requests to unicornd (register a task, stop a task)."""
        return self._key("control")

    def operator_control(self) -> str:
        """Stream: operators' requests to unicornd (drain, resume, and those of ``control``).

        A separate stream so Redis ACLs, not the client, decide who may drain: only the
        operator and coordinator users may write it.
        """
        return self._key("ops")

    def reply(self, stream: str, entry_id: str) -> str:
        """String: unicornd's verdict on request ``entry_id`` of ``stream`` (a control stream)."""
        if stream not in (self.control(), self.operator_control()):
            raise InvalidArgument(f"{stream!r} is not one of unicornd's control streams")
        if re.fullmatch(r"[0-9]+-[0-9]+", entry_id) is None:
            raise InvalidArgument(f"invalid stream entry id {entry_id!r}")
        return f"{stream}:reply:{entry_id}"

    def job_env(self, job_id: int) -> str:
        """String: the training command's environment and working directory (JSON,
        :class:`unicorn_core.jobenv.JobEnvironment`); read by the job's agents only."""
        return self._key("env", _job_id(job_id))

    def agent_password(self, job_id: int) -> str:
        """String: the password of the Redis user of ``job_id``'s agents (coordinator only)."""
        return self._key("secret", "agent", _job_id(job_id))
