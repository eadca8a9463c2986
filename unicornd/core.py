"""The one writer of unicornd's state: input -> decide -> resolve -> commit -> followers.

Every input (an agent's message, a control request, a Slurm observation, the clock, an
action's outcome) reaches :meth:`Core.decide` as a pure function of the snapshot. The
decision is resolved (:func:`unicornd.decide.resolve`: the replan it asks for, new
agents' command lines) and committed with its actions in one transaction
(:class:`unicornd.store.Store`); only then do the followers (detector expectations,
alerts, metrics) see it and the executor wake.

Progress is the one input committed lazily: a decision that only raises tasks' iteration
marks changes the snapshot in memory, and the stream entries that caused it are
acknowledged only after a later commit covers them (at most :data:`PROGRESS_EVERY`
iterations or one tick later). A kill -9 in between loses nothing: the entries are still
pending in Redis and are delivered again on restart, so the restarted daemon decides
exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Final

from unicorn_core.errors import UnicornError
from unicorn_core.logs import get_logger
from unicornd import decide, goodput
from unicornd.actions import Decision, Outcome, Replan
from unicornd.ledgerstore import SAVE_EVERY_S, save_ledger
from unicornd.replan import PlanContext
from unicornd.state import Snapshot, TaskRecord
from unicornd.store import Owed, Store

log = get_logger(__name__)

PROGRESS_EVERY: Final = 10
"""Commit a task's iteration mark once it is this many iterations ahead of the committed
one (else within a tick): the snapshot's mark is never far behind, and a busy cluster
does not commit on every iteration."""
_PROGRESS_FIELDS: Final = frozenset(
    {"last_iteration", "last_iteration_s", "recoveries_without_progress", "first_iteration_s"}
)

Follower = Callable[[Snapshot, Snapshot, Decision], None]
"""(committed before, committed after, the decision) -> None; must not raise or block."""


def _progress_only(before: Snapshot, decision: Decision) -> bool:
    """The decision only moves tasks' iteration marks and the measurements that come with
    them (a lazy commit is enough: the calibration's iteration times are counted only past
    the mark, so the entries delivered again after a crash measure exactly what was lost)."""
    if decision.actions or decision.nodes or decision.incidents or decision.cancels:
        return False
    if decision.drop_tasks or decision.drop_incidents:
        return False
    if decision.plan_generation is not None or decision.plan_basis is not None:
        return False
    for task in decision.tasks:
        old = before.tasks.get(task.task_id)
        if old is None:
            return False
        changed = {f.name for f in fields(TaskRecord) if getattr(old, f.name) != getattr(task, f.name)}
        if not changed <= _PROGRESS_FIELDS:
            return False
    return True


async def _resolve(snap: Snapshot, decision: Decision, ctx: PlanContext, now_s: float) -> Decision:
    """:func:`unicornd.decide.resolve`; one that replans runs in a worker thread. The solve
    takes 0.2 s at 4,096 nodes (``scripts/bench/scale.py``); on the event loop it would hold
    every other input (heartbeats, Slurm, replies) that long. Under the lock, with an
    immutable snapshot and pure functions, the decision is the same either way."""
    if any(isinstance(a, Replan) for a in decision.actions):
        return await asyncio.to_thread(decide.resolve, snap, decision, ctx, now_s)
    return decide.resolve(snap, decision, ctx, now_s)


class Core:
    """The snapshot, the lock around deciding, and the commit (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        ctx: PlanContext,
        followers: Sequence[Follower] = (),
    ) -> None:
        self.store = store
        self.ctx = ctx
        self.followers = list(followers)
        self.snapshot: Snapshot | None = None
        self.committed: Snapshot | None = None
        self.wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._held: dict[str, list[str]] = {}
        self._ackable: dict[str, list[str]] = {}
        self.ledger: goodput.Ledger | None = None
        """The goodput ledger, advanced after every commit (None: none kept; the daemon
        sets it from Redis before :meth:`start`)."""
        self.clock: Callable[[], float] = time.time
        self._ledger_saved_s = -math.inf

    @property
    def snap(self) -> Snapshot:
        assert self.snapshot is not None, "state not loaded"
        return self.snapshot

    @property
    def dirty(self) -> bool:
        """The snapshot in memory is ahead of the committed one (progress only)."""
        return self.snapshot is not self.committed

    async def start(self, snap: Snapshot) -> None:
        """Commit ``snap`` as the starting state (loaded, reconciled with Slurm)."""
        async with self._lock:
            await self.store.commit(snap)
            await self._account(snap)
            self._set_committed(snap, snap, Decision())

    async def decide(self, now_s: float, fn: Callable[[Snapshot], Decision]) -> Decision:
        """Decide on one input (``fn`` is pure), resolve, commit unless it is progress only."""
        async with self._lock:
            snap = self.snap
            decision = fn(snap)
            if decision.empty and decision.plan_generation is None:
                self._log(decision)
                return decision
            resolved = await _resolve(snap, decision, self.ctx, now_s)
            after = resolved.applied_to(snap)
            if _progress_only(snap, resolved) and not self._progress_due(after):
                self.snapshot = after
                return resolved
            await self._commit(after, resolved)
            return resolved

    async def finish(self, owed: Owed, outcome: Outcome, now_s: float) -> Decision:
        """``owed`` ran with ``outcome``: decide on it and commit that decision together with
        the action's removal from the owed list (one transaction)."""
        async with self._lock:
            snap = self.snap
            decision = await _resolve(snap, decide.on_outcome(snap, outcome, now_s), self.ctx, now_s)
            await self._commit(decision.applied_to(snap), decision, finished=owed)
            return decision

    async def flush(self) -> None:
        """Commit progress held in memory (the ticker calls this every second). With nothing
        to commit, the goodput ledger still advances and is saved when a save is due, so
        the saved ledger is never more than a save interval old (a task's finish, the
        last commit of a quiet cluster, reaches ``unicornctl goodput``)."""
        async with self._lock:
            if self.dirty:
                await self._commit(self.snap, Decision())
            elif self.committed is not None and self.clock() - self._ledger_saved_s >= SAVE_EVERY_S:
                await self._account(self.committed)

    def handled(self, stream: str, entry_id: str) -> None:
        """A stream entry was handled: it may be acknowledged once the state it changed is
        committed (at once when nothing is held in memory, else after the next commit)."""
        (self._held if self.dirty else self._ackable).setdefault(stream, []).append(entry_id)

    def ackable(self) -> dict[str, list[str]]:
        """Entries covered by a commit, to acknowledge now (taken: the next call has new ones)."""
        out, self._ackable = self._ackable, {}
        return out

    # --- inside the lock ------------------------------------------------------------

    def _progress_due(self, after: Snapshot) -> bool:
        committed = self.committed
        assert committed is not None
        for task in after.tasks.values():
            old = committed.tasks.get(task.task_id)
            mark = old.last_iteration if old is not None else None
            if task.last_iteration is not None and (
                mark is None or task.last_iteration >= mark + PROGRESS_EVERY
            ):
                return True
        return False

    async def _commit(self, after: Snapshot, decision: Decision, *, finished: Owed | None = None) -> None:
        voided = await self.store.commit(after, decision.actions, cancels=decision.cancels, finished=finished)
        before = self.committed or after
        await self._account(after)
        self._set_committed(before, after, decision)
        for action in voided:
            log.info("action_voided", action=action.action_id, kind=action.kind)
        self._log(decision)
        if decision.actions:
            self.wake.set()
        for stream, ids in self._held.items():
            self._ackable.setdefault(stream, []).extend(ids)
        self._held = {}

    async def _account(self, after: Snapshot) -> None:
        """Advance the goodput ledger over a commit and save it when due. Never raises:
        accounting must not stop recovery (a ledger that cannot advance is dropped, logged;
        a save that fails is retried with the next commit)."""
        if self.ledger is None:
            return
        now = self.clock()
        try:
            self.ledger = goodput.advance(self.ledger, after, now, self.ctx.gpu, self.ctx.assume)
        except Exception as e:  # a bug in the accounting, never in the state
            log.error("goodput_ledger_dropped", error=repr(e))
            self.ledger = None
            return
        if now - self._ledger_saved_s >= SAVE_EVERY_S:
            try:
                await save_ledger(
                    self.store.client,
                    self.store.keys,
                    self.ledger,
                    token=self.store.token,
                    holder=self.store.holder,
                )
                self._ledger_saved_s = now
            except UnicornError as e:
                log.warning("goodput_ledger_not_saved", error=str(e))

    def _set_committed(self, before: Snapshot, after: Snapshot, decision: Decision) -> None:
        self.snapshot = after
        self.committed = after
        for follow in self.followers:
            follow(before, after, decision)

    @staticmethod
    def _log(decision: Decision) -> None:
        for note in decision.notes:
            log.info("decision", note=note)
