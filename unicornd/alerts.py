"""Alerts: what changed between two snapshots that an operator must hear about, and delivery.

:func:`alerts_for` is pure (no I/O, no clock): it compares the snapshot before a decision
with the one after it and derives one :class:`Alert` per event:

==================  =========================================================================
kind                when
==================  =========================================================================
``opened``          an incident id appears
``escalated``       the incident climbs a rung (retry_in_place < restart_processes < isolate);
                    the first rung after detection is the response, not an escalation, and
                    ``replan``/``transition`` belong to the isolate rung
``needs_operator``  the incident enters ``escalated_to_operator`` (the no-progress breaker or
                    budget stopped the task, the drain limiter wants a confirmation, or a
                    rung timed out with nothing left to isolate), or, while waiting there,
                    it asks to drain another node
``closed``          the incident closes; carries the time from detection to each milestone
==================  =========================================================================

Alert ids are deterministic (incident id, kind, timeline position), so an alert derived
again after a crash has the same id and a receiver can drop the duplicate.

:class:`AlertSink` delivers alerts to a command (argv, JSON on stdin) and/or a webhook
(HTTP POST of JSON), each with a timeout, from a bounded queue that drops its oldest
entry when full. It never raises into the daemon loop: failures are logged and returned
as typed errors (:class:`~unicorn_core.errors.ExternalCallError` subclasses).

The timeline helpers (:func:`incident_milestones`, :func:`stage_spans`) are shared with
the metrics and ``unicornctl incidents``.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from unicorn_core import proc
from unicorn_core.config import AlertsConfig
from unicorn_core.errors import CommandFailed, ExternalCallError
from unicorn_core.logs import get_logger
from unicornd.state import Incident, LadderStage, Snapshot, TaskState

_L = LadderStage

# --- timelines -----------------------------------------------------------------------

RUNG_LEVEL: Final[Mapping[LadderStage, int]] = {
    _L.RETRY_IN_PLACE: 1,
    _L.RESTART_PROCESSES: 2,
    _L.ISOLATE: 3,
}
"""The ladder's rungs by height. Other stages are not rungs: ``replan`` and ``transition``
follow an isolation, ``resumed``/``closed``/``escalated_to_operator`` end the climb."""


@dataclass(frozen=True)
class Milestones:
    """When an incident reached each milestone (wall-clock seconds; None: not reached).

    ``classified``: the first rung was chosen (the finding's severity named it);
    ``drained``: the first drain was ordered and a replan asked (entering ``replan``);
    ``replanned``: the first new plan was being applied (entering ``transition``);
    ``resumed``: iterations advanced again; ``closed``: the incident ended.
    """

    detected_s: float
    classified_s: float | None = None
    drained_s: float | None = None
    replanned_s: float | None = None
    resumed_s: float | None = None
    closed_s: float | None = None

    def since_detected(self) -> dict[str, float]:
        """Seconds from detection to each milestone reached (keys without ``_s``)."""
        out: dict[str, float] = {}
        for name in ("classified", "drained", "replanned", "resumed", "closed"):
            t = getattr(self, f"{name}_s")
            if t is not None:
                out[name] = t - self.detected_s
        return out


def incident_milestones(inc: Incident) -> Milestones:
    """The first time each milestone appears in the incident's timeline."""
    detected = inc.timeline[0].t_s if inc.timeline and inc.timeline[0].stage is _L.DETECTED else inc.opened_s
    first: dict[str, float] = {}
    for entry in inc.timeline:
        if entry.stage in RUNG_LEVEL:
            first.setdefault("classified_s", entry.t_s)
        name = _MILESTONE_OF.get(entry.stage)
        if name is not None:
            first.setdefault(name, entry.t_s)
    return Milestones(detected_s=detected, **first)


_MILESTONE_OF: Final[Mapping[LadderStage, str]] = {
    _L.REPLAN: "drained_s",
    _L.TRANSITION: "replanned_s",
    _L.RESUMED: "resumed_s",
    _L.CLOSED: "closed_s",
}


@dataclass(frozen=True)
class StageSpan:
    """One timeline entry with how long the incident stayed there.

    ``duration_s`` runs to the next entry; for the last entry of an open incident it runs
    to ``now_s`` (``ongoing``); a ``closed`` entry lasts 0.
    """

    stage: LadderStage
    start_s: float
    since_detected_s: float
    duration_s: float
    ongoing: bool


def stage_spans(inc: Incident, now_s: float) -> tuple[StageSpan, ...]:
    """The timeline as spans (see :class:`StageSpan`)."""
    detected = incident_milestones(inc).detected_s
    spans = []
    for i, entry in enumerate(inc.timeline):
        last = i == len(inc.timeline) - 1
        if not last:
            end = inc.timeline[i + 1].t_s
        else:
            end = entry.t_s if entry.stage is _L.CLOSED else max(now_s, entry.t_s)
        spans.append(
            StageSpan(entry.stage, entry.t_s, entry.t_s - detected, end - entry.t_s, last and inc.is_open)
        )
    return tuple(spans)


# --- alerts --------------------------------------------------------------------------


class AlertKind(enum.StrEnum):
    """What happened to the incident (see the module docstring)."""

    OPENED = "opened"
    ESCALATED = "escalated"
    NEEDS_OPERATOR = "needs_operator"
    CLOSED = "closed"


class OperatorReason(enum.StrEnum):
    """Why an incident needs an operator: ``breaker`` (the no-progress breaker or the
    recovery budget stopped the task), ``drain_limit`` (confirm the drain of
    ``pending_drain``), ``stuck`` (a rung timed out with nothing left to isolate)."""

    BREAKER = "breaker"
    DRAIN_LIMIT = "drain_limit"
    STUCK = "stuck"


@dataclass(frozen=True)
class Alert:
    """One event of one incident, as delivered (``to_json``).

    ``event_s``: when it happened (its timeline entry); ``derived_s``: when
    :func:`alerts_for` saw it. ``from_stage``/``to_stage``: the climb of an ``escalated``
    alert. ``durations_s``: for ``closed``, seconds from detection to each milestone
    (:meth:`Milestones.since_detected`).
    """

    alert_id: str
    kind: AlertKind
    incident: Incident
    event_s: float
    derived_s: float
    summary: str
    task_name: str | None = None
    job_id: int | None = None
    from_stage: LadderStage | None = None
    to_stage: LadderStage | None = None
    operator_reason: OperatorReason | None = None
    durations_s: Mapping[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types: the alert's fields and the whole incident record."""
        return {
            "alert_id": self.alert_id,
            "kind": self.kind.value,
            "summary": self.summary,
            "event_s": self.event_s,
            "derived_s": self.derived_s,
            "incident_id": self.incident.incident_id,
            "task_id": self.incident.task_id,
            "task_name": self.task_name,
            "job_id": self.job_id,
            "node": self.incident.node,
            "status": self.incident.status.value,
            "severity": self.incident.severity.value,
            "stage": self.incident.stage.value,
            "from_stage": None if self.from_stage is None else self.from_stage.value,
            "to_stage": None if self.to_stage is None else self.to_stage.value,
            "operator_reason": None if self.operator_reason is None else self.operator_reason.value,
            "durations_s": None if self.durations_s is None else dict(self.durations_s),
            "incident": self.incident.to_dict(),
        }


def alerts_for(before: Snapshot, after: Snapshot, now_s: float) -> list[Alert]:
    """The alerts for what changed from ``before`` to ``after`` (``now_s``: the decision's clock).

    Pure and deterministic. Incidents only in ``before`` (pruned) give nothing; an
    incident that opens and closes within one decision (an idle node drained) gives
    both ``opened`` and ``closed``. Ordered by incident (opening time, id), then by event.
    """
    out: list[Alert] = []
    for inc in sorted(after.incidents.values(), key=lambda i: (i.opened_s, i.incident_id)):
        old = before.incidents.get(inc.incident_id)
        if old is inc:  # unchanged records are shared between snapshots: nothing to compare
            continue
        out.extend(_incident_alerts(old, inc, after, now_s))
    return out


def _incident_alerts(old: Incident | None, inc: Incident, after: Snapshot, now_s: float) -> list[Alert]:
    task = after.tasks.get(inc.task_id) if inc.task_id is not None else None

    def alert(suffix: str, kind: AlertKind, event_s: float, summary: str, **extra: Any) -> Alert:
        return Alert(
            alert_id=f"{inc.incident_id}/{suffix}",
            kind=kind,
            incident=inc,
            event_s=event_s,
            derived_s=now_s,
            summary=f"incident {inc.incident_id} {summary}",
            task_name=None if task is None else task.name,
            job_id=None if task is None else task.job_id,
            **extra,
        )

    where = f"{inc.status.value} ({inc.severity.value}) on {inc.node}" + (
        f", task {inc.task_id}" if inc.task_id is not None else ", no task"
    )
    out: list[Alert] = []
    if old is None:
        out.append(
            alert("opened", AlertKind.OPENED, inc.opened_s, f"opened: {where}; stage {inc.stage.value}")
        )
    start = 0 if old is None else len(old.timeline)
    level = 0
    for i, entry in enumerate(inc.timeline):
        new_level = RUNG_LEVEL.get(entry.stage)
        climbed = new_level is not None and level >= 1 and new_level > level
        prev = inc.timeline[i - 1].stage if i else _L.DETECTED
        if i >= start and climbed:
            text = f"escalated: {prev.value} -> {entry.stage.value} ({where})"
            out.append(
                alert(
                    f"escalated/{i}",
                    AlertKind.ESCALATED,
                    entry.t_s,
                    text,
                    from_stage=prev,
                    to_stage=entry.stage,
                )
            )
        if i >= start and entry.stage is _L.ESCALATED_TO_OPERATOR:
            reason = _operator_reason(inc, after)
            text = f"needs an operator ({reason.value}): {inc.note or where}"
            out.append(
                alert(
                    f"needs_operator/{i}", AlertKind.NEEDS_OPERATOR, entry.t_s, text, operator_reason=reason
                )
            )
        if i >= start and entry.stage is _L.CLOSED:
            spans = incident_milestones(inc).since_detected()
            total = spans.get("closed", entry.t_s - inc.opened_s)
            text = f"closed after {total:.1f} s: {inc.note or where}"
            out.append(alert("closed", AlertKind.CLOSED, entry.t_s, text, durations_s=spans))
        if new_level is not None:
            level = new_level
    if (
        old is not None
        and old.stage is _L.ESCALATED_TO_OPERATOR
        and inc.stage is _L.ESCALATED_TO_OPERATOR
        and inc.pending_drain is not None
        and inc.pending_drain != old.pending_drain
    ):
        text = f"needs an operator ({OperatorReason.DRAIN_LIMIT.value}): {inc.note or where}"
        out.append(
            alert(
                f"needs_operator/drain/{inc.pending_drain}",
                AlertKind.NEEDS_OPERATOR,
                inc.last_action_s,
                text,
                operator_reason=OperatorReason.DRAIN_LIMIT,
            )
        )
    return out


def _operator_reason(inc: Incident, after: Snapshot) -> OperatorReason:
    if inc.pending_drain is not None:
        return OperatorReason.DRAIN_LIMIT
    task = after.tasks.get(inc.task_id) if inc.task_id is not None else None
    if task is not None and task.state is TaskState.STOPPED:
        return OperatorReason.BREAKER
    return OperatorReason.STUCK


# --- delivery ------------------------------------------------------------------------


class WebhookError(ExternalCallError):
    """The webhook did not accept an alert. ``exit_code`` is the HTTP status when one came
    back (None: no answer: refused, timed out, DNS). Temporary: a later alert may pass."""

    temporary = True


@dataclass(frozen=True)
class DeliveryResult:
    """What happened to one alert: ``errors`` holds one entry per target that failed."""

    alert_id: str
    errors: tuple[ExternalCallError, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors


_RESPONSE_BYTES: Final = 65536


def _redacted(url: str) -> str:
    """Scheme, host and port only: webhook paths and queries often carry the secret."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}/..."


def _post(url: str, body: bytes, timeout_s: float) -> int:
    """POST ``body`` as JSON; the HTTP status (urllib raises on >= 400). Blocking."""
    request = urllib.request.Request(  # noqa: S310 - the config admits only http(s) URLs
        url, data=body, method="POST", headers={"Content-Type": "application/json", "User-Agent": "unicornd"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - as above
        response.read(_RESPONSE_BYTES)
        return int(response.status)


class AlertSink:
    """Delivers alerts to the configured command and/or webhook (see the module docstring).

    :meth:`submit` queues (never blocks, never raises); :meth:`run` delivers forever and
    is meant to be one of the daemon's root tasks; :meth:`flush` delivers what is queued
    now. Counters ``delivered``, ``failed`` (alerts with at least one failed target) and
    ``dropped`` (queue overflow) are for metrics and logs.
    """

    def __init__(self, cfg: AlertsConfig) -> None:
        self.cfg = cfg
        self.delivered = 0
        self.failed = 0
        self.dropped = 0
        self._queue: collections.deque[Alert] = collections.deque()
        self._ready = asyncio.Event()
        self._log = get_logger("unicornd.alerts")

    @property
    def enabled(self) -> bool:
        """Whether any target is configured (if not, :meth:`submit` ignores alerts)."""
        return bool(self.cfg.command or self.cfg.webhook_url)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def submit(self, alerts: Iterable[Alert]) -> None:
        """Queue ``alerts``; when the queue is full the oldest waiting alert is dropped."""
        if not self.enabled:
            return
        for a in alerts:
            if len(self._queue) >= self.cfg.queue_max:
                lost = self._queue.popleft()
                self.dropped += 1
                self._log.warning("alert dropped: queue full", alert_id=lost.alert_id, dropped=self.dropped)
            self._queue.append(a)
        if self._queue:
            self._ready.set()

    async def run(self) -> None:
        """Deliver queued alerts one at a time, forever (cancel to stop)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            await self.flush()

    async def flush(self) -> list[DeliveryResult]:
        """Deliver every alert queued now, oldest first; their results."""
        results = []
        while self._queue:
            results.append(await self.deliver(self._queue.popleft()))
        return results

    async def deliver(self, alert: Alert) -> DeliveryResult:
        """Send ``alert`` to every configured target at once; never raises (but cancels)."""
        body = json.dumps(alert.to_json(), separators=(",", ":"))
        tries = []
        if self.cfg.command:
            tries.append(self._run_command(body))
        if self.cfg.webhook_url:
            tries.append(self._post_webhook(body))
        errors = tuple(e for e in await asyncio.gather(*tries) if e is not None)
        if errors:
            self.failed += 1
            for e in errors:
                self._log.warning(
                    "alert delivery failed", alert_id=alert.alert_id, kind=alert.kind.value, error=str(e)
                )
        else:
            self.delivered += 1
            self._log.info("alert delivered", alert_id=alert.alert_id, kind=alert.kind.value)
        return DeliveryResult(alert.alert_id, errors)

    async def _run_command(self, body: str) -> ExternalCallError | None:
        argv = self.cfg.command
        try:
            await proc.run(argv, timeout_s=self.cfg.timeout_s, input_text=body)
        except ExternalCallError as e:
            return e
        except OSError as e:  # not executable, too many processes, ...
            return CommandFailed(argv, None, message=f"{type(e).__name__}: {e}")
        return None

    async def _post_webhook(self, body: str) -> ExternalCallError | None:
        shown = ("POST", _redacted(self.cfg.webhook_url))
        timeout_s = self.cfg.timeout_s
        try:
            status = await asyncio.wait_for(
                asyncio.to_thread(_post, self.cfg.webhook_url, body.encode(), timeout_s), timeout_s
            )
        except TimeoutError:
            return WebhookError(shown, None, message=f"timed out after {timeout_s:g} s")
        except urllib.error.HTTPError as e:
            return WebhookError(shown, e.code, message=f"HTTP {e.code} {e.reason}")
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            return WebhookError(shown, None, message=f"{type(e).__name__}: {reason}")
        if not 200 <= status < 300:
            return WebhookError(shown, status, message=f"HTTP {status}")
        return None
