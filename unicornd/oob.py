"""Out-of-band confirmation of a silent agent: probe the node over SSH, then judge.

A lost heartbeat has two very different causes. A dead node (power, kernel panic,
network) must be drained and the task moved; a dead agent on a healthy node (killed,
crashed, OOM-killed) only needs the agent and the task's processes restarted. Draining
a healthy node for a dead agent costs the task a transition and the cluster a node.

:func:`probe_node` (I/O) asks the node through :mod:`unicorn_core.ssh` to run
``unicorn-probe``; :func:`verdict` (pure) turns the answer into a classification:

===========================================  ===============  ====================  ==========
probe answer                                 status           severity, rule        confirms
===========================================  ===============  ====================  ==========
no answer (timeout, no route, dropped)       lost_connection  SEV1 ssh_unreachable  ssh
refused (port, auth, host key): host up      lost_connection  SEV2 probe_denied     -
kernel log has a fault line (Xid, ECC, MCE)  from the rules   the rule's (Xid 79:   kernel_log
                                                              SEV1)
no agent process for the job                 lost_connection  SEV2 agent_lost       -
agent process stopped (T) or a zombie        lost_connection  SEV2 agent_silent     -
agent process running or sleeping            lost_connection  SEV3 agent_slow       -
probe ran but its answer is unreadable       lost_connection  SEV2 probe_failed     -
===========================================  ===============  ====================  ==========

Only the first and third rows confirm a node fault (:mod:`detect.isolation`): the node
did not answer at all, or its own kernel logged a fault. A host that answers is up, so a
refused connection or login and an unreadable answer restart the agent; they never drain
the node (a probe misconfigured at a site must not drain its cluster).

A stopped or dead agent cannot take commands (it reads them from the same Redis), so its
restart rung starts a new agent. A running agent that is late is starved or cut off from
Redis (its outbox buffers): SEV3 waits in place, and a retry that sees no progress climbs
to the restart as any SEV3 does. Measured: with 4 ranks importing torch on 2 cores, live
agents were 1.5 s late.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from detect.classify import Classification, Classifier
from detect.isolation import Confirmation
from detect.statuses import ErrorStatus, Severity, worst
from unicorn_core.config import AgentConfig, SshConfig
from unicorn_core.errors import CommandTimeout, SshUnreachable
from unicorn_core.ssh import Endpoint, run
from unicornd.decide import AGENT_LOST, AGENT_SILENT, SSH_UNREACHABLE
from unicornd.launch import bin_dir

_EVIDENCE_CHARS = 900
PROBE_DENIED = "probe_denied"
PROBE_FAILED = "probe_failed"
_PROBE_RULES = frozenset(
    {SSH_UNREACHABLE, PROBE_DENIED, PROBE_FAILED, AGENT_LOST, AGENT_SILENT, "agent_slow"}
)
_DEAD_STATES = frozenset({"stopped", "traced", "zombie"})


@dataclass(frozen=True)
class ProbeResult:
    """What a probe found. ``reachable`` False: ``detail`` says why no session opened."""

    node: str
    job_id: int
    reachable: bool
    detail: str = ""
    answered: bool = False
    agent_states: tuple[str, ...] = ()
    kernel_lines: tuple[str, ...] = ()
    kernel_error: str = ""
    elapsed_s: float = 0.0
    network: bool = True
    """When not ``reachable``: no route to sshd (False: the host answered and refused the session)."""


def endpoint_of(cfg: SshConfig, node: str) -> Endpoint:
    """The node's SSH endpoint: from ``ssh.hosts``, else its Slurm name on port 22."""
    host, port = cfg.endpoints().get(node, (node, 22))
    return Endpoint(host, port, cfg.user, cfg.key_file, cfg.known_hosts)


def probe_argv(cfg: SshConfig, agent: AgentConfig, node: str, job_id: int) -> list[str]:
    """The command the node runs (``unicorn-probe`` from the agent's bin dir)."""
    argv = [str(bin_dir(agent) / "unicorn-probe"), "--job-id", str(job_id), "--node", node]
    return [*argv, "--kernel-log", cfg.kernel_log] if cfg.kernel_log else argv


async def probe_node(cfg: SshConfig, agent: AgentConfig, node: str, job_id: int) -> ProbeResult:
    """Probe ``node`` about ``job_id``'s agent; never raises for the node's own failures."""
    t0 = time.monotonic()
    argv = probe_argv(cfg, agent, node, job_id)
    try:
        out = await run(
            endpoint_of(cfg, node),
            argv,
            connect_timeout_s=cfg.connect_timeout_s,
            command_timeout_s=cfg.command_timeout_s,
        )
    except SshUnreachable as e:
        return ProbeResult(node, job_id, False, e.detail, elapsed_s=time.monotonic() - t0, network=e.network)
    except CommandTimeout as e:
        return ProbeResult(node, job_id, True, str(e), elapsed_s=time.monotonic() - t0)
    elapsed = time.monotonic() - t0
    try:
        doc = json.loads(out.stdout)
        states = tuple(str(a["state"]) for a in doc["agents"])
        lines = tuple(str(x) for x in doc["kernel_lines"])
        kernel_error = str(doc.get("kernel_error", ""))
    except (ValueError, KeyError, TypeError):
        tail = (out.stderr.strip() or out.stdout.strip())[-300:]
        return ProbeResult(node, job_id, True, f"probe exited {out.exit_code}: {tail}", elapsed_s=elapsed)
    return ProbeResult(node, job_id, True, "", True, states, lines, kernel_error, elapsed)


def verdict(result: ProbeResult, silence: str, classifier: Classifier) -> Classification:
    """The classification of a silent agent given the probe's ``result`` (table above).

    ``silence`` is the heartbeat finding's evidence; the probe's findings are appended.
    """
    where = f"ssh {result.node}"
    if not result.reachable:
        if result.network:
            return _lost(Severity.SEV1, SSH_UNREACHABLE, f"{silence}; {where}: {result.detail}")
        where += ": host up, session refused"
        return _lost(Severity.SEV2, PROBE_DENIED, f"{silence}; {where}: {result.detail}")
    kernel = [classifier.classify_line(line) for line in result.kernel_lines]
    faults = [c for c in kernel if c.is_fault]
    if faults:
        sev = worst(c.severity for c in faults)
        first = next(c for c in faults if c.severity is sev)
        lines = " | ".join(c.evidence for c in faults if c.severity is sev)
        evidence = f"kernel log of {result.node}: {lines}; {silence}"
        return Classification(first.status, first.severity, first.rule, evidence[:_EVIDENCE_CHARS])
    if not result.answered:
        return _lost(Severity.SEV2, PROBE_FAILED, f"{silence}; {where}: {result.detail}")
    note = f"; kernel log unreadable: {result.kernel_error}" if result.kernel_error else ""
    states = ", ".join(result.agent_states)
    if not result.agent_states:
        severity, rule, evidence = (
            Severity.SEV2,
            AGENT_LOST,
            f"{silence}; {where}: node up, agent not running{note}",
        )
    elif all(s in _DEAD_STATES for s in result.agent_states):
        severity, rule, evidence = (
            Severity.SEV2,
            AGENT_SILENT,
            f"{silence}; {where}: node up, agent {states} but silent{note}",
        )
    else:
        severity, rule, evidence = (
            Severity.SEV3,
            "agent_slow",
            f"{silence}; {where}: node up, agent {states} but silent{note}",
        )
    return _lost(severity, rule, evidence)


def confirmation(result: ProbeResult, found: Classification) -> str:
    """What the probe's verdict ``found`` confirms (a :class:`Confirmation` value, "" for
    nothing): no route to the node (``ssh``), or a fault in its kernel log (``kernel_log``)."""
    if not result.reachable:
        return Confirmation.SSH if result.network else ""
    return "" if found.rule in _PROBE_RULES else Confirmation.KERNEL_LOG


def _lost(severity: Severity, rule: str, evidence: str) -> Classification:
    return Classification(ErrorStatus.LOST_CONNECTION, severity, rule, evidence[:_EVIDENCE_CHARS])
