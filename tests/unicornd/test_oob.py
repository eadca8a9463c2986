"""Out-of-band confirmation: the probe's verdict table, the ladder's agent restart, the
node-side agent lookup, and the SSH choke point's error for an unreachable node."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from detect import load_classifier
from detect.statuses import ErrorStatus, Severity
from launcher.probe import find_agents, kernel_lines
from tests.conftest import free_port
from tests.unicornd.coord_world import apply, finding, of_kind, task, world
from unicorn_core.config import SshConfig
from unicorn_core.errors import InvalidArgument, SshUnreachable
from unicorn_core.protocol import AgentAction
from unicorn_core.ssh import Endpoint, run
from unicornd.actions import RestartAgent, SendCommand
from unicornd.decide import on_finding
from unicornd.oob import ProbeResult, endpoint_of, verdict
from unicornd.state import LadderStage, NodeHealth

XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."
SILENCE = "no heartbeat from node n2 of job 1 for 1.6 s"
CLASSIFIER = load_classifier(None)
T0 = 1_700_000_000.0


@pytest.mark.parametrize(
    ("result", "status", "severity", "rule", "evidence"),
    [
        (ProbeResult("n2", 1, False, "ConnectionRefusedError"), "lost_connection", "SEV1", "ssh_unreachable",
         "ConnectionRefusedError"),
        (ProbeResult("n2", 1, True, "", True), "lost_connection", "SEV2", "agent_lost", "agent not running"),
        (ProbeResult("n2", 1, True, "", True, ("stopped",)), "lost_connection", "SEV2", "agent_silent",
         "agent stopped but silent"),
        (ProbeResult("n2", 1, True, "probe exited 127: not found"), "lost_connection", "SEV2", "probe_failed",
         "not found"),
        (ProbeResult("n2", 1, True, "", True, (), (XID79,)),
         "gpu_driver_error", "SEV1", "xid_79", "kernel log of n2: NVRM: Xid"),
        (ProbeResult("n2", 1, True, "", True, ("sleeping",), ("usb 1-1: new device",)), "lost_connection",
         "SEV3", "agent_slow", "agent sleeping"),
        (ProbeResult("n2", 1, True, "", True, ("zombie",)), "lost_connection", "SEV2", "agent_silent",
         "agent zombie"),
    ],
)  # fmt: skip
def test_verdict_table(result: ProbeResult, status: str, severity: str, rule: str, evidence: str) -> None:
    c = verdict(result, SILENCE, CLASSIFIER)
    assert (c.status.value, c.severity, c.rule) == (status, Severity(severity), rule)
    assert evidence in c.evidence and SILENCE in c.evidence


def test_worst_kernel_line_wins_and_unreadable_log_is_said() -> None:
    lines = (
        "NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception",
        "NVRM: Xid (PCI:0000:3b:00): 79, fallen off",
    )
    assert verdict(ProbeResult("n2", 1, True, "", True, (), lines), SILENCE, CLASSIFIER).rule == "xid_79"
    c = verdict(ProbeResult("n2", 1, True, "", True, (), (), "dmesg exited 1: denied"), SILENCE, CLASSIFIER)
    assert c.rule == "agent_lost" and "kernel log unreadable: dmesg exited 1" in c.evidence


def test_endpoints_from_config_and_bad_entries() -> None:
    cfg = SshConfig(hosts=("n1=10.0.0.1:2222",), user="unicorn", known_hosts="/k")
    assert endpoint_of(cfg, "n1") == Endpoint("10.0.0.1", 2222, "unicorn", "", "/k")
    assert endpoint_of(cfg, "n7") == Endpoint("n7", 22, "unicorn", "", "/k")
    assert SshConfig(hosts=("n1=host", "=h:1", "n2=h:0", "n3=h:22")).problems() == [
        "hosts entry 'n1=host' is not NODE=HOST:PORT",
        "hosts entry '=h:1' is not NODE=HOST:PORT",
        "hosts entry 'n2=h:0' is not NODE=HOST:PORT",
    ]
    with pytest.raises(InvalidArgument):
        Endpoint("bad host")


def _agent_lost(node: str = "n2") -> object:
    f = finding("hb:1:n2:probe", 1, node, ErrorStatus.LOST_CONNECTION, rank=None, severity=Severity.SEV2)
    return replace(f, rule="agent_lost")


def test_dead_agent_restarts_the_agent_there_and_ranks_elsewhere_without_drain() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"])])
    d = on_finding(snap, _agent_lost(), T0)  # type: ignore[arg-type]
    assert [(a.node, a.action) for a in of_kind(d.actions, SendCommand)] == [
        ("n1", AgentAction.RESTART_RANKS)
    ]
    assert of_kind(d.actions, RestartAgent) == [
        RestartAgent("a.1/restart_processes/1/restart_agent/n2", "a", 1, "n2")
    ]
    after = apply(snap, d)
    assert after.incidents["a.1"].stage is LadderStage.RESTART_PROCESSES
    assert all(n.health is NodeHealth.HEALTHY for n in after.nodes.values())


def test_dead_agent_twice_climbs_to_isolation() -> None:
    snap = world(4, [task("a", 1, ["n1", "n2"])])
    snap = apply(snap, on_finding(snap, _agent_lost(), T0))  # type: ignore[arg-type]
    again = replace(_agent_lost(), finding_id="hb:1:n2:again:probe")  # type: ignore[type-var]
    d = on_finding(snap, again, T0 + snap.policy.settle_s + 1)  # type: ignore[arg-type]
    assert not of_kind(d.actions, RestartAgent)
    assert apply(snap, d).incidents["a.1"].stage in (LadderStage.ISOLATE, LadderStage.REPLAN)


def test_find_agents_matches_job_and_node_only(tmp_path: Path) -> None:
    exe = tmp_path / "unicorn-agent"
    exe.write_text("import time\ntime.sleep(60)\n")
    procs = [
        subprocess.Popen(
            [sys.executable, str(exe), "--job-id", job, "--node", node, "--", "x", "--node", "n2"]
        )
        for job, node in (("7", "n2"), ("8", "n2"), ("7", "n3"))
    ]
    try:
        found = find_agents(7, "n2")
        # A process just started may be reading its modules (D, "disk-wait"): any live state.
        assert [a.pid for a in found] == [procs[0].pid]
        assert found[0].state in ("sleeping", "running", "disk-wait")
        os.kill(procs[0].pid, 19)  # SIGSTOP
        deadline = time.monotonic() + 10
        while find_agents(7, "n2")[0].state != "stopped" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert find_agents(7, "n2")[0].state == "stopped"
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert find_agents(7, "n2") == []


def test_kernel_lines_keep_hardware_messages_only(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(
        "eth0: link up\nNVRM: Xid (PCI:0000:3b:00): 48, DBE (double bit error)\n"
        "mce: [Hardware Error]: Machine check events logged\nsystemd[1]: started\n"
    )
    lines, error = kernel_lines(str(log))
    assert error == "" and len(lines) == 2 and lines[0].startswith("NVRM: Xid")
    assert kernel_lines(str(tmp_path / "missing"))[1].startswith("FileNotFoundError")


def test_ssh_to_a_closed_port_is_unreachable_fast() -> None:
    port = free_port()  # nobody listens there
    with pytest.raises(SshUnreachable) as info:
        asyncio.run(run(Endpoint("127.0.0.1", port), ["true"], connect_timeout_s=2, command_timeout_s=2))
    assert (
        info.value.command[:2] == ("ssh", f"root@127.0.0.1:{port}") and "refused" in str(info.value).lower()
    )


def test_dead_agent_found_during_a_restart_gets_a_new_agent() -> None:
    """A rank's exception started the restart; the agent found dead after it still gets restarted."""
    snap = world(4, [task("a", 1, ["n1", "n2"])])
    snap = apply(snap, on_finding(snap, finding("exc", 1, "n1", ErrorStatus.OTHER_SOFTWARE_ERROR), T0))
    assert snap.incidents["a.1"].stage is LadderStage.RESTART_PROCESSES
    d = on_finding(snap, _agent_lost(), T0 + 2)  # type: ignore[arg-type]
    assert of_kind(d.actions, RestartAgent) == [
        RestartAgent("a.1/restart_processes/1/restart_agent/n2", "a", 1, "n2")
    ]
    assert apply(snap, d).incidents["a.1"].stage is LadderStage.RESTART_PROCESSES
