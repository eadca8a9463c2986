"""The command-line backend: works with every Slurm >= 22.05 (sinfo/squeue --json, scontrol -o).

All commands go through :func:`unicorn_core.proc.run` (timeout, typed errors). Slurm's
client environment variables (``SLURM_JOB_ID``, ``SBATCH_*``...) are stripped so a
coordinator started inside a job cannot have its commands silently retargeted.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from unicorn_core import proc
from unicorn_core.errors import (
    CommandFailed,
    CommandNotFound,
    CommandTimeout,
    InvalidArgument,
    UnicornError,
    UnknownJob,
    UnknownNode,
)
from unicorn_core.proc import CommandOutput
from unicorn_core.slurm.backend import ResizeUnsupported, StepHandle, UnknownReservation
from unicorn_core.slurm.hostlist import compress
from unicorn_core.slurm.parse import (
    GroupedSinfo,
    SlurmParseError,
    job_from_scontrol,
    jobs_from_squeue_json,
    nodes_from_scontrol_json,
    nodes_from_sinfo_json,
    parse_partitions,
    parse_reservation_nodes,
    parse_scontrol_record,
    tres_limits,
)
from unicorn_core.slurm.types import (
    GrowResult,
    JobInfo,
    JobLimits,
    JobState,
    NodeInfo,
    check_job_id,
    check_node_name,
    check_reason,
)

_CLIENT_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SCONTROL_")
_GRANTED = re.compile(r"Granted job allocation (\d+)")
_RESIZE_REFUSED = ("db_index", "Unexpected message", "Job expansion not allowed", "not supported")
REQUEUE_START_DELAY_S = 2
"""Seconds between a requeued job turning PENDING and its earliest start (see ``requeue``)."""


def client_env(base: Mapping[str, str], slurm_conf: str | None) -> dict[str, str]:
    """``base`` without Slurm client variables, with ``SLURM_CONF`` set if given."""
    env = {k: v for k, v in base.items() if not k.startswith(_CLIENT_ENV_PREFIXES) or k == "SLURM_CONF"}
    if slurm_conf:
        env["SLURM_CONF"] = slurm_conf
    return env


class CliSlurm:
    """:class:`~unicorn_core.slurm.backend.SlurmBackend` over Slurm's command-line tools."""

    name = "cli"

    def __init__(
        self,
        *,
        timeout_s: float = 30.0,
        bin_dir: str | Path | None = None,
        slurm_conf: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.bin_dir = Path(bin_dir) if bin_dir else None
        self.env = client_env(os.environ if env is None else env, slurm_conf)
        self._nodes_by_scontrol = False  # set once sinfo --json prints grouped records

    # ------------------------------------------------------------------ plumbing

    def _argv(self, tool: str, *args: str) -> list[str]:
        exe = str(self.bin_dir / tool) if self.bin_dir else tool
        return [exe, *args]

    async def _run(self, tool: str, *args: str, input_text: str | None = None) -> str:
        out = await proc.run(
            self._argv(tool, *args), timeout_s=self.timeout_s, env=self.env, input_text=input_text
        )
        return out.stdout

    async def _update_nodes(self, nodes: Sequence[str], *fields: str) -> None:
        """One ``scontrol update nodename=<hostlist>`` for every node of ``nodes``: one
        slurmctld RPC. slurmctld updates the list node by node: with an unknown name in it
        (``Invalid node name specified``, exit 1) the known ones are changed all the same
        (22.05, on the dev cluster), so the error names the unknown ones."""
        if not nodes:
            raise InvalidArgument("no node to update")
        for node in nodes:
            check_node_name(node)
        try:
            await self._run("scontrol", "update", f"nodename={compress(list(nodes))}", *fields)
        except CommandFailed as e:
            if "Invalid node name" in e.stderr or "not found" in e.stderr:
                known = [n.name for n in await self.list_nodes()]
                unknown = [n for n in nodes if n not in known]
                raise UnknownNode(",".join(unknown or nodes), known) from e
            raise

    # ------------------------------------------------------------------ nodes

    async def version(self) -> str:
        out = await self._run("sinfo", "--version")
        return out.strip().split()[-1]

    async def list_nodes(self) -> list[NodeInfo]:
        """Every node. ``sinfo --json`` while it prints one record per node (22.05); once it
        prints grouped records (newer releases, e.g. 24.11), ``scontrol show node --json``
        from then on. Told apart by the output's shape, not by a version number."""
        # Parsed in a worker thread: ``sinfo --json`` of 4,096 nodes is 4 MB, 70 ms of
        # parsing that would hold unicornd's event loop every poll (scripts/bench/scale.py).
        if not self._nodes_by_scontrol:
            try:
                return await asyncio.to_thread(nodes_from_sinfo_json, await self._run("sinfo", "--json"))
            except GroupedSinfo:
                self._nodes_by_scontrol = True
        out = await self._run("scontrol", "show", "node", "--json")
        return await asyncio.to_thread(nodes_from_scontrol_json, out)

    async def get_node(self, name: str) -> NodeInfo:
        check_node_name(name)
        nodes = await self.list_nodes()
        for n in nodes:
            if n.name == name:
                return n
        raise UnknownNode(name, [n.name for n in nodes])

    async def list_partitions(self) -> list[str]:
        """Every partition's name (``scontrol -o show partition``)."""
        return parse_partitions(await self._run("scontrol", "-o", "show", "partition"))

    async def job_limits(self, job_id: int) -> JobLimits:
        """The most nodes and GPUs Slurm's policy lets job ``job_id`` hold: its partition's
        MaxNodes, its QoS's and its association's MaxTRESPerJob (``node=``, ``gres/gpu=``)
        and the association's MaxNodes. Without accounting (sacctmgr cannot reach slurmdbd)
        only the partition's. unicorn plans no task beyond them: a requeue onto more nodes
        than the QoS allows is refused by slurmctld and leaves the job pending
        (BadConstraints; measured on 22.05 with ``MaxTRESPerJob=node=2``)."""
        rec = await self._job_record(job_id)
        nodes: list[tuple[int, str]] = []
        gpus: list[tuple[int, str]] = []
        partition = rec.get("Partition", "")
        if partition:
            out = await self._run("scontrol", "-o", "show", "partition", partition)
            part = parse_scontrol_record(out) if out.strip() else {}
            if part.get("MaxNodes", "").isdigit():
                nodes.append((int(part["MaxNodes"]), f"partition {partition}: MaxNodes={part['MaxNodes']}"))
        qos, account = rec.get("QOS", ""), rec.get("Account", "")
        user = rec.get("UserId", "").split("(")[0]
        queries: list[tuple[str, tuple[str, ...]]] = []
        if qos and qos != "(null)":
            queries.append((f"QoS {qos}", ("show", "qos", qos, "format=MaxTRESPerJob")))
        if account and account != "(null)" and user:
            where = ("where", f"user={user}", f"account={account}")
            queries.append(
                (f"association {user}/{account}", ("show", "assoc", *where, "format=MaxTRES,MaxNodes"))
            )
        for what, query in queries:
            try:
                out = await self._run("sacctmgr", "-n", "-P", *query)
            except (CommandFailed, CommandNotFound, CommandTimeout):
                continue  # no accounting here (or slurmdbd does not answer): no QoS or association limits
            for line in out.splitlines():
                fields = line.split("|")
                n, g = tres_limits(fields[0])
                if len(fields) > 1 and fields[1].isdigit():
                    n = int(fields[1]) if n is None else min(n, int(fields[1]))
                if n is not None:
                    nodes.append((n, f"{what}: nodes {n}"))
                if g is not None:
                    gpus.append((g, f"{what}: gres/gpu={g}"))
        return JobLimits(
            max_nodes=min(nodes)[0] if nodes else None,
            max_gpus=min(gpus)[0] if gpus else None,
            sources=tuple(why for _, why in sorted(nodes) + sorted(gpus)),
        )

    async def reservation_nodes(self, name: str) -> tuple[str, ...]:
        """The nodes of reservation ``name`` (``scontrol -o show reservation NAME``)."""
        if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise InvalidArgument(f"invalid reservation name {name!r}")
        try:
            out = await self._run("scontrol", "-o", "show", "reservation", name)
        except CommandFailed as e:  # 22.05: "Reservation X not found" on stdout, exit 1
            if "not found" in e.stdout + e.stderr:
                raise UnknownReservation(name) from e
            raise
        nodes = parse_reservation_nodes(out, name)
        if nodes is None:
            raise UnknownReservation(name)
        return nodes

    async def drain(self, node: str, reason: str) -> None:
        await self.drain_nodes([node], reason)

    async def drain_nodes(self, nodes: Sequence[str], reason: str) -> None:
        await self._update_nodes(nodes, "state=drain", f"reason={check_reason(reason)}")

    async def down(self, node: str, reason: str) -> None:
        await self.down_nodes([node], reason)

    async def down_nodes(self, nodes: Sequence[str], reason: str) -> None:
        await self._update_nodes(nodes, "state=down", f"reason={check_reason(reason)}")

    async def resume(self, node: str) -> None:
        await self._update_nodes([node], "state=resume")

    # ------------------------------------------------------------------ jobs

    async def list_jobs(self) -> list[JobInfo]:
        return await asyncio.to_thread(jobs_from_squeue_json, await self._run("squeue", "--json"))

    async def get_job(self, job_id: int) -> JobInfo:
        return job_from_scontrol(await self._job_record(job_id))

    async def _job_record(self, job_id: int) -> dict[str, str]:
        """``scontrol -o show job J`` as key=value; :class:`UnknownJob` for a job Slurm lacks."""
        check_job_id(job_id)
        try:
            out = await self._run("scontrol", "-o", "show", "job", str(job_id))
        except CommandFailed as e:
            if "Invalid job id" in e.stderr:
                raise UnknownJob(job_id) from e
            raise
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if not lines:
            raise SlurmParseError(f"scontrol show job {job_id} printed nothing")
        return parse_scontrol_record(lines[0])

    async def submit_batch(self, script: str, options: Sequence[str] = ()) -> int:
        """``sbatch --parsable [options]`` with the script on stdin; returns the job id."""
        if not script.startswith("#!"):
            raise InvalidArgument("a batch script must start with '#!'")
        out = await self._run("sbatch", "--parsable", *options, input_text=script)
        first = out.strip().split(";")[0]
        if not first.isdigit():
            raise SlurmParseError(f"sbatch --parsable printed {out.strip()!r}")
        return int(first)

    async def launch_step(
        self,
        job_id: int,
        nodes: Sequence[str],
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        options: Sequence[str] = (),
        capture: bool = True,
    ) -> StepHandle:
        """Start one task per node on ``nodes`` of running job ``job_id`` (``--overlap``)."""
        check_job_id(job_id)
        if not nodes:
            raise InvalidArgument("launch_step needs at least one node")
        for n in nodes:
            check_node_name(n)
        if not argv:
            raise InvalidArgument("launch_step needs a command")
        job = await self.get_job(job_id)
        if job.state is not JobState.RUNNING:
            raise InvalidArgument(f"job {job_id} is {job.state_raw}, not RUNNING")
        missing = [n for n in nodes if n not in job.nodes]
        if missing:
            raise InvalidArgument(f"nodes {missing} are not in job {job_id} ({compress(job.nodes)})")
        cmd = self._argv(
            "srun",
            f"--jobid={job_id}",
            f"--nodelist={compress(list(nodes))}",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1",
            "--overlap",
            "--kill-on-bad-exit=0",
            "--quiet",
            *options,
            *argv,
        )
        step_env = dict(self.env)
        if env:
            step_env.update(env)
        process = await proc.start(cmd, env=step_env, capture=capture)
        return StepHandle(job_id, tuple(nodes), tuple(cmd), process)

    async def run_on_nodes(
        self,
        nodes: Sequence[str],
        argv: Sequence[str],
        *,
        timeout_s: float,
        job_id: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandOutput:
        """Run ``argv`` once per node on ``nodes`` with srun and wait (output, exit code).

        Without ``job_id`` srun allocates the nodes itself (they must be free); with it the
        tasks run as an ``--overlap`` step of that job. A non-zero exit is returned, not
        raised: for checks, failing is an answer. Raises CommandTimeout past ``timeout_s``.
        """
        if not nodes or not argv:
            raise InvalidArgument("run_on_nodes needs nodes and a command")
        for n in nodes:
            check_node_name(n)
        where: list[str] = []
        if job_id is not None:
            check_job_id(job_id)
            where = [f"--jobid={job_id}", "--overlap"]
        cmd = self._argv(
            "srun",
            *where,
            f"--nodelist={compress(list(nodes))}",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
            "--quiet",
            *argv,
        )
        step_env = dict(self.env)
        if env:
            step_env.update(env)
        return await proc.run(cmd, timeout_s=timeout_s, env=step_env, check=False)

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        """Release every node of the job except ``keep_nodes`` (their steps are killed).

        Done already when the job holds exactly ``keep_nodes``: a node set DOWN leaves a
        ``--no-kill`` job by itself, and slurmctld then refuses the same update ("Unexpected
        message received"; measured on 22.05), before or while this call runs.
        :class:`ResizeUnsupported` when the shrink would remove the batch host (Slurm never
        allows it; unicornd then requeues the job onto ``keep_nodes``)."""
        check_job_id(job_id)
        if not keep_nodes:
            raise InvalidArgument("shrink must keep at least one node (cancel the job instead)")
        # scontrol's record, whatever backend reads jobs elsewhere: it names the batch host.
        job = job_from_scontrol(await self._job_record(job_id))
        if set(job.nodes) == set(keep_nodes):
            return
        extra = [n for n in keep_nodes if n not in job.nodes]
        if extra:
            raise InvalidArgument(f"nodes {extra} are not in job {job_id} ({compress(job.nodes)})")
        if job.batch and job.batch_host in job.nodes and job.batch_host not in keep_nodes:
            # slurmctld would answer only "Invalid node name specified" (found in CI: a job
            # allocated on n2 and grown onto n1 could not be shrunk onto n1).
            raise ResizeUnsupported(
                f"job {job_id} cannot shrink off {job.batch_host}: it runs the job's batch script"
            )
        try:
            await self._run("scontrol", "update", f"jobid={job_id}", f"NodeList={compress(list(keep_nodes))}")
        except CommandFailed as e:
            try:
                now = await self.get_job(job_id)
            except UnicornError:
                raise e from None  # the update's own failure says more than the lookup's
            if set(now.nodes) == set(keep_nodes):
                return  # slurmctld removed the others meanwhile (a node set DOWN)
            if any(s in e.stderr for s in _RESIZE_REFUSED):
                raise ResizeUnsupported(f"job {job_id} cannot shrink now: {e.stderr.strip()}") from e
            raise

    async def grow(self, job_id: int, add_nodes: int, *, exclude: Sequence[str] = ()) -> GrowResult:
        """Add ``add_nodes`` nodes to a running job by Slurm job expansion.

        A helper allocation (``salloc --no-shell --dependency=expand:J``) is created on
        free nodes, its nodes are handed to J (``NumNodes=0``) and the helper is
        cancelled. Needs ``SchedulerParameters=permit_job_expansion``; raises
        :class:`ResizeUnsupported` when the cluster refuses.

        A job holding GRES (GPUs) is refused here, before any helper exists: slurmctld
        (22.05 and 24.11) answers "has allocated GRES" only when the helper's nodes are
        handed over, and that failure leaves the helper broken (a ``run_job_cnt``
        underflow; on 22.05 it stays COMPLETING). Such a job grows by requeue.
        """
        check_job_id(job_id)
        if add_nodes < 1:
            raise InvalidArgument(f"add_nodes must be >= 1, got {add_nodes}")
        # scontrol's record, whatever backend reads jobs elsewhere: it names the GRES.
        job = job_from_scontrol(await self._job_record(job_id))
        if job.state is not JobState.RUNNING:
            raise InvalidArgument(f"job {job_id} is {job.state_raw}, not RUNNING")
        if job.holds_gres:
            raise ResizeUnsupported(
                f"job {job_id} holds GRES ({job.gres}): Slurm does not expand such a job; requeue it"
            )
        avoid = compress([*job.nodes, *exclude])
        try:
            out = await proc.run(
                self._argv(
                    "salloc",
                    "--no-shell",
                    f"--nodes={add_nodes}",
                    f"--exclude={avoid}",
                    f"--dependency=expand:{job_id}",
                    f"--job-name=unicorn-expand-{job_id}",
                    "--immediate=5",
                ),
                timeout_s=self.timeout_s,
                env=self.env,
            )
        except CommandFailed as e:
            if any(s in e.stderr for s in _RESIZE_REFUSED):
                raise ResizeUnsupported(f"job {job_id} cannot grow: {e.stderr.strip()}") from e
            raise
        m = _GRANTED.search(out.stderr + out.stdout)
        if m is None:
            raise SlurmParseError(f"salloc did not report an allocation: {out.stderr.strip()!r}")
        helper = int(m.group(1))
        try:
            await self._run("scontrol", "update", f"jobid={helper}", "NumNodes=0")
        except CommandFailed as e:
            await self.cancel(helper)
            raise ResizeUnsupported(f"job {job_id} cannot grow: {e.stderr.strip()}") from e
        await self.cancel(helper)
        after = await self.get_job(job_id)
        return GrowResult(job_id, "expand", tuple(n for n in after.nodes if n not in job.nodes))

    async def requeue(
        self, job_id: int, nodes: Sequence[str] = (), *, placed: Callable[[], None] | None = None
    ) -> None:
        """Requeue a batch job and let it start again as soon as nodes allow.

        With ``nodes`` the job restarts on exactly those (``NumNodes`` and ``ReqNodeList``
        are set while it is pending; a pending job's node count can be lowered, not
        raised). Slurm holds a requeued job until ``cred_expire``; once it is PENDING,
        setting ``StartTime=now+2`` makes it eligible in 2 s (``now`` at once revokes its
        credential). No event wakes the scheduler when that time passes, so the job would
        wait for the next periodic pass (~20 s on the dev cluster): once the 2 s are over,
        ``StartTime=now`` pokes it (measured: RUNNING 2.5-2.8 s after the requeue).
        ``placed`` is called once the job is pending with its nodes and start time set,
        before those 2 s.
        """
        check_job_id(job_id)
        for n in nodes:
            check_node_name(n)
        try:
            await self._run("scontrol", "requeue", str(job_id))
        except CommandFailed as e:
            if "Invalid job id" in e.stderr:
                raise UnknownJob(job_id) from e
            # Already pending: requeued by Slurm itself (a node of the job went DOWN) or by
            # this call's first run before unicornd died. Its node list must still be set,
            # or it waits for the node it lost.
            if "pending" not in f"{e.stdout} {e.stderr}".lower():
                raise
        deadline = time.monotonic() + self.timeout_s
        while (await self.get_job(job_id)).state is not JobState.PENDING:
            if time.monotonic() > deadline:
                return  # Slurm restarts it on its own after cred_expire.
            await asyncio.sleep(0.05)
        where = [f"NumNodes={len(nodes)}", f"ReqNodeList={compress(list(nodes))}"] if nodes else []
        start = f"StartTime=now+{REQUEUE_START_DELAY_S}"
        await self._run("scontrol", "update", f"jobid={job_id}", *where, start)
        if placed is not None:
            placed()
        await asyncio.sleep(REQUEUE_START_DELAY_S + 0.2)
        if (await self.get_job(job_id)).state is JobState.PENDING:
            await self._run("scontrol", "update", f"jobid={job_id}", "StartTime=now")

    async def cancel(self, job_id: int, *, signal: str | None = None) -> None:
        check_job_id(job_id)
        args = [f"--signal={signal}"] if signal else []
        out = await proc.run(
            self._argv("scancel", "--verbose", *args, str(job_id)),
            timeout_s=self.timeout_s,
            env=self.env,
            check=False,
        )
        # scancel exits 0 for an unknown job id (Slurm 22.05); only --verbose says so on stderr.
        if "Invalid job id" in out.stderr:
            raise UnknownJob(job_id)
        if out.exit_code != 0:
            raise CommandFailed(out.command, out.exit_code, out.stdout, out.stderr)
