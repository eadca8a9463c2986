"""``unicornctl report --html``: one self-contained HTML page of the cluster (issue 21).

Pure: :func:`render_html` is a function of unicornd's :class:`~unicornd.state.Snapshot`, its
goodput :class:`~unicornd.goodput.Ledger` (None: none kept yet), the clock and the window; no
I/O. The page has

* the nodes (health, GPUs, the task on each, drained/held, "not ours" where other users'
  jobs hold it), table ``#nodes``;
* each task's layout history (state, TP/PP/DP, GPUs, nodes, the nodes that changed): a
  timeline ``svg#layouts`` and table ``#layout-history``;
* the incidents as a Gantt chart ``svg#gantt``: one row per incident, aligned at its
  detection, one bar per ladder stage (``rect.bar`` with ``data-stage``) coloured by stage,
  labelled with task, node, status, severity and stage; table ``#incidents``;
* achieved vs ideal WAF over time, ``svg#waf`` (step lines ``#waf-ideal``/``#waf-achieved``
  from the ledger's series, incident detections marked), the lost work by cause (table
  ``#causes``, stacked bar ``svg#lost``) and by task (table ``#task-goodput``).

Contract: every string from the state is HTML-escaped; the page loads nothing (a
Content-Security-Policy of ``default-src 'none'`` with inline styles only, no script, no
URL); it is well-formed XML after the doctype, so the SVG fragments parse on their own.
Times are shown in the local time zone.
"""

from __future__ import annotations

import html
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from unicornd.alerts import stage_spans
from unicornd.goodput import HISTORY_KEEP_S, Cause, LayoutChange, Ledger, Totals, WafSample
from unicornd.state import KEEP_CLOSED_S, Incident, LadderStage, NodeHealth, Snapshot, TaskState

_W: Final = 960
"""Width of every chart (SVG user units; the page scales them to its width)."""
_CAUSE_COLOUR: Final = {
    Cause.DETECTION: "#d62728",
    Cause.DECISION_DRAIN: "#ff7f0e",
    Cause.TRANSITION: "#9467bd",
    Cause.RECOMPUTATION: "#8c564b",
    Cause.SUB_HEALTHY: "#e377c2",
    Cause.IDLE: "#bcbd22",
}
_STAGE_COLOUR: Final = {
    LadderStage.DETECTED: "#d62728",
    LadderStage.RETRY_IN_PLACE: "#ffbb78",
    LadderStage.RESTART_PROCESSES: "#ff7f0e",
    LadderStage.ISOLATE: "#9467bd",
    LadderStage.REPLAN: "#8c564b",
    LadderStage.TRANSITION: "#1f77b4",
    LadderStage.RESUMED: "#2ca02c",
    LadderStage.ESCALATED_TO_OPERATOR: "#e377c2",
    LadderStage.CLOSED: "#7f7f7f",
}
_STATE_COLOUR: Final = {
    TaskState.PENDING: "#c7c7c7",
    TaskState.LAUNCHING: "#6baed6",
    TaskState.RUNNING: "#2ca02c",
    TaskState.RECOVERING: "#ff7f0e",
    TaskState.FINISHED: "#525252",
    TaskState.FAILED: "#d62728",
    TaskState.STOPPED: "#9467bd",
}
CSP: Final = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
"""The page's Content-Security-Policy: it may load nothing (inline styles only)."""
_TIME_STEPS: Final = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200)
_DAY: Final = 86400.0

_CSS: Final = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5em auto;
  max-width: 1000px; padding: 0 1em; color: #222; background: #fff; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
p.meta, p.note { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.out td { background: #fdecea; }
tr.foreign td { background: #eef3fb; }
svg { width: 100%; height: auto; display: block; margin: 0.5em 0; }
svg text { font-size: 11px; fill: #222; }
svg .axis line, svg .axis path { stroke: #555; }
svg line.grid, svg .axis line.grid { stroke: #e5e5e5; }
svg .label { font-size: 12px; }
svg .rowbg { fill: #f7f7f7; }
svg .clipped { font-size: 11px; fill: #555; }
polyline.series { fill: none; stroke-width: 2; }
polyline.ideal { stroke: #1f77b4; stroke-dasharray: 6 3; }
polyline.achieved { stroke: #2ca02c; }
line.incident-mark { stroke: #d62728; stroke-opacity: 0.5; }
ul.legend { list-style: none; padding: 0; margin: 0.3em 0; font-size: 0.85em; }
ul.legend li { display: inline-block; margin-right: 1em; }
span.swatch { display: inline-block; width: 0.9em; height: 0.9em; vertical-align: middle;
  margin-right: 0.3em; border: 1px solid #999; }
span.dash-ideal { background: #1f77b4; }
span.dash-achieved { background: #2ca02c; }
"""


def _e(value: object) -> str:
    """``value`` as text, escaped for HTML text and attribute values."""
    return html.escape(str(value), quote=True)


def _css_classes() -> str:
    rules = [f".stage-{s.value} {{ fill: {c}; background: {c}; }}" for s, c in _STAGE_COLOUR.items()]
    rules += [f".state-{s.value} {{ fill: {c}; background: {c}; }}" for s, c in _STATE_COLOUR.items()]
    rules += [f".cause-{k.value} {{ fill: {c}; background: {c}; }}" for k, c in _CAUSE_COLOUR.items()]
    rules.append(".achieved-work { fill: #2ca02c; background: #2ca02c; }")
    rules.append(".unattributed-work { fill: #dddddd; background: #dddddd; }")
    return _CSS + "\n".join(rules) + "\n"


# --- formatting --------------------------------------------------------------------------


def _clock(t_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_s))


def _duration(s: float) -> str:
    """A duration for people: ``4.2 s``, ``3m 05s``, ``2h 10m``, ``3d 4h``, ``1d``."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f} s"
    whole = int(s)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < _DAY:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    hours = whole % 86400 // 3600
    return f"{whole // 86400}d {hours}h" if hours else f"{whole // 86400}d"


def _num(v: float) -> str:
    return f"{v:.4g}"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _layout_text(change: LayoutChange) -> str:
    lay = change.layout
    if lay is None:
        return "-"
    vpp = f" VPP{lay.vpp}" if lay.vpp is not None else ""
    return f"TP{lay.tp} PP{lay.pp} DP{lay.dp}{vpp}"


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" … (+{len(names) - limit})" if len(names) > limit else "")


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Num(str):
    """A right-aligned (numeric) table cell."""

    __slots__ = ()


def _table(
    table_id: str, head: Sequence[str], rows: Iterable[Sequence[str]], classes: Sequence[str] = ()
) -> str:
    """A table; every cell is escaped, :class:`_Num` cells are right-aligned; ``classes``:
    each row's class (by position; missing or empty: none)."""
    out = [f'<table id="{_e(table_id)}"><thead><tr>']
    out += [f"<th>{_e(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        cls = classes[i] if i < len(classes) else ""
        out.append(f'<tr class="{_e(cls)}">' if cls else "<tr>")
        for cell in row:
            attr = ' class="num"' if isinstance(cell, _Num) else ""
            out.append(f"<td{attr}>{_e(cell)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


_n = _Num


# --- axes --------------------------------------------------------------------------------


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Ticks 0, step, ... up to the first multiple of a 1/2/2.5/5 x 10^k step at or above
    ``top`` (about ``count`` intervals); ``[0, 1]`` when ``top`` <= 0."""
    if not math.isfinite(top) or top <= 0:
        return [0.0, 1.0]
    raw = top / count
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw * (1 - 1e-9))
    n = max(1, math.ceil(top / step - 1e-9))
    return [i * step for i in range(n + 1)]


def time_ticks(lo: float, hi: float, count: int = 6) -> tuple[list[float], str]:
    """Ticks at round local times in [lo, hi] (at most about ``count``) and their strftime
    format."""
    span = max(hi - lo, 1e-9)
    step = next((float(s) for s in _TIME_STEPS if span / s <= count), 0.0)
    if step == 0.0:
        step = _DAY * max(1, math.ceil(span / count / _DAY))
    off = time.localtime(lo).tm_gmtoff
    first = math.ceil((lo + off) / step) * step - off
    ticks = []
    t = first
    while t <= hi + 1e-9:
        ticks.append(t)
        t += step
    fmt = "%H:%M:%S" if step < 60 else ("%H:%M" if span <= _DAY else "%m-%d %H:%M")
    return ticks, fmt


def duration_ticks(top: float, count: int = 6) -> list[float]:
    """Ticks 0..``top`` seconds at a round step (s, min, h)."""
    if top <= 0:
        return [0.0]
    step = next((float(s) for s in _TIME_STEPS if top / s <= count), 0.0)
    if step == 0.0:
        step = _DAY * max(1, math.ceil(top / count / _DAY))
    return [i * step for i in range(int(top // step) + 1)]


# --- sections ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """The time the report covers: [``start_s``, ``end_s``]."""

    start_s: float
    end_s: float

    def x(self, t_s: float, x0: float, width: float) -> float:
        """``t_s`` on an axis from ``x0`` ``width`` wide (clamped to it)."""
        frac = (t_s - self.start_s) / (self.end_s - self.start_s)
        return x0 + width * min(1.0, max(0.0, frac))


def _nodes_section(snap: Snapshot, gpu_type: str | None) -> str:
    rows, classes = [], []
    for node in sorted(snap.nodes.values(), key=lambda n: n.name):
        owner = snap.owner(node.name)
        foreign = snap.foreign_jobs(node.name)
        out = node.health is not NodeHealth.HEALTHY or node.held
        cls = "out" if out else ("foreign" if foreign else "")
        task = (
            "-"
            if owner is None
            else (owner.name if owner.name == owner.task_id else f"{owner.name} ({owner.task_id})")
        )
        state = "held (until an operator resumes it)" if node.held else ""
        if not state and node.health in (NodeHealth.DRAINING, NodeHealth.DRAINED):
            state = node.health.value
        classes.append(cls)
        rows.append(
            [
                node.name,
                node.health.value,
                node.reason or "",
                _n(str(snap.gpus_per_node)),
                gpu_type or "unknown",
                task,
                state or "-",
                f"not ours (jobs {', '.join(map(str, foreign))})" if foreign else "ours",
                _n(str(len(node.failures_s))),
                _n(str(len(node.drains_s))),
            ]
        )
    head = [
        "node",
        "health",
        "reason",
        "GPUs",
        "GPU type",
        "task",
        "drained/held",
        "owner",
        "failures",
        "drains",
    ]
    if not rows:
        return '<h2 id="nodes-title">Nodes</h2><p class="note">unicornd knows no nodes.</p>'
    return '<h2 id="nodes-title">Nodes</h2>' + _table("nodes", head, rows, classes)


def _task_label(snap: Snapshot, task_id: str) -> str:
    task = snap.tasks.get(task_id)
    if task is None or task.name == task_id:
        return task_id
    return f"{task.name} ({task_id})"


def _layouts_section(snap: Snapshot, ledger: Ledger | None, win: Window) -> str:
    task_ids = sorted(set(snap.tasks) | (set(ledger.tasks) if ledger else set()))
    out = ['<h2 id="layouts-title">Task layouts</h2>']
    if not task_ids:
        return out[0] + '<p class="note">No tasks.</p>'
    histories = {
        tid: (ledger.tasks[tid].layouts if ledger and tid in ledger.tasks else []) for tid in task_ids
    }
    label_w, x0 = 230, 240
    plot_w = _W - x0 - 10
    row_h, top = 24, 10
    height = top + row_h * len(task_ids) + 34
    svg = [f'<svg id="layouts" viewBox="0 0 {_W} {height}" role="img" aria-label="Task layouts over time">']
    for i, tid in enumerate(task_ids):
        y = top + i * row_h
        label = _task_label(snap, tid)
        svg.append(f'<rect class="rowbg" x="0" y="{y}" width="{_W}" height="{row_h - 2}"/>' if i % 2 else "")
        svg.append(
            f'<text x="4" y="{y + 15}" class="label"><title>{_e(label)}</title>'
            f"{_e(_short(label, label_w // 7))}</text>"
        )
        hist = histories[tid]
        if not hist:
            svg.append(f'<text x="{x0}" y="{y + 15}">no layout history recorded</text>')
        for j, ch in enumerate(hist):
            until = hist[j + 1].t_s if j + 1 < len(hist) else win.end_s
            if until < win.start_s or ch.t_s > win.end_s:
                continue
            xa, xb = win.x(ch.t_s, x0, plot_w), win.x(until, x0, plot_w)
            w = max(xb - xa, 1.0)
            text = f"{ch.state.value} {_layout_text(ch)} {ch.gpus} GPUs on {ch.nodes} nodes"
            tip = f"{label}: {text}, {_clock(ch.t_s)} for {_duration(until - ch.t_s)}"
            svg.append(
                f'<rect class="seg state-{ch.state.value}" data-task="{_e(tid)}" x="{xa:.1f}" y="{y + 2}" '
                f'width="{w:.1f}" height="{row_h - 6}"><title>{_e(tip)}</title></rect>'
            )
            short = _layout_text(ch) if ch.layout is not None else ch.state.value
            if w > 7 * len(short) + 6:
                svg.append(f'<text x="{xa + 3:.1f}" y="{y + 15}">{_e(short)}</text>')
    svg.append(_time_axis(win, x0, plot_w, top + row_h * len(task_ids) + 2))
    svg.append("</svg>")
    out.append("".join(svg))
    out.append(_legend((f"state-{s.value}", s.value) for s in TaskState))
    rows = []
    for tid in task_ids:
        hist = histories[tid]
        for j, ch in enumerate(hist):
            nxt = hist[j + 1].t_s if j + 1 < len(hist) else None
            end = nxt if nxt is not None else win.end_s
            if end < win.start_s:
                continue
            changes = [*(f"+{n}" for n in ch.added), *(f"\N{MINUS SIGN}{n}" for n in ch.removed)]
            rows.append(
                [
                    _task_label(snap, tid),
                    _clock(ch.t_s),
                    _duration(end - ch.t_s) + ("" if nxt is not None else " (now)"),
                    ch.state.value,
                    _layout_text(ch),
                    _n(str(ch.gpus)),
                    _n(str(ch.nodes)),
                    _names(changes) if changes else "",
                ]
            )
    head = ["task", "from", "for", "state", "layout", "GPUs", "nodes", "nodes changed"]
    out.append(_table("layout-history", head, rows))
    return "".join(out)


def _time_axis(win: Window, x0: float, width: float, y: float, *, grid_top: float | None = None) -> str:
    ticks, fmt = time_ticks(win.start_s, win.end_s)
    parts = [f'<g class="axis x-axis"><line x1="{x0}" y1="{y}" x2="{x0 + width}" y2="{y}"/>']
    for t in ticks:
        x = win.x(t, x0, width)
        if grid_top is not None:
            parts.append(f'<line class="grid" x1="{x:.1f}" y1="{grid_top}" x2="{x:.1f}" y2="{y}"/>')
        parts.append(f'<line class="tick" x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}"/>')
        label = time.strftime(fmt, time.localtime(t))
        parts.append(f'<text x="{x:.1f}" y="{y + 16}" text-anchor="middle">{_e(label)}</text>')
    parts.append("</g>")
    return "".join(parts)


def _legend(items: Iterable[tuple[str, str]]) -> str:
    lis = "".join(f'<li><span class="swatch {_e(cls)}"></span>{_e(text)}</li>' for cls, text in items)
    return f'<ul class="legend">{lis}</ul>'


def _merged_spans(inc: Incident, now_s: float) -> list[tuple[LadderStage, float, float]]:
    """(stage, start, end) per stage the incident passed through, consecutive entries of the
    same stage merged (notes), in time order."""
    out: list[tuple[LadderStage, float, float]] = []
    for span in stage_spans(inc, now_s):
        end = span.start_s + span.duration_s
        if out and out[-1][0] is span.stage:
            out[-1] = (span.stage, out[-1][1], end)
        else:
            out.append((span.stage, span.start_s, end))
    return out


def incidents_in(snap: Snapshot, start_s: float, now_s: float) -> list[Incident]:
    """The snapshot's incidents that overlap [start_s, now_s], by detection time and id."""
    shown = []
    for inc in snap.incidents.values():
        spans = _merged_spans(inc, now_s)
        end = max((e for _, _, e in spans), default=inc.opened_s)
        if end >= start_s or inc.is_open:
            shown.append((spans[0][1] if spans else inc.opened_s, inc.incident_id, inc))
    return [inc for _, _, inc in sorted(shown, key=lambda r: (r[0], r[1]))]


def _gantt_section(snap: Snapshot, incidents: list[Incident], now_s: float) -> str:
    out = ['<h2 id="incidents-title">Incidents</h2>']
    if not incidents:
        return out[0] + '<p class="note">No incidents in this window.</p>'
    rows = [(inc, _merged_spans(inc, now_s)) for inc in incidents]

    def begin(spans: list[tuple[LadderStage, float, float]], inc: Incident) -> float:
        return spans[0][1] if spans else inc.opened_s

    totals = [
        max((e for _, _, e in spans), default=begin(spans, inc)) - begin(spans, inc) for inc, spans in rows
    ]
    longest = max(totals)
    scale = max(1.0, min(longest, max(30.0, 4 * statistics.median_low(totals))))
    label_w, x0 = 380, 390
    plot_w = _W - x0 - 110
    row_h, top = 24, 8
    height = top + row_h * len(rows) + 40
    svg = [f'<svg id="gantt" viewBox="0 0 {_W} {height}" role="img" aria-label="Incident timelines">']
    for i, ((inc, spans), total) in enumerate(zip(rows, totals, strict=True)):
        y = top + i * row_h
        t0 = begin(spans, inc)
        task = _task_label(snap, inc.task_id) if inc.task_id else "(idle node)"
        label = (
            f"{inc.incident_id} · {task} · {inc.node} · {inc.status.value} "
            f"{inc.severity.value} · {inc.stage.value}"
        )
        svg.append(
            f'<g class="incident" id="incident-{i}" data-incident="{_e(inc.incident_id)}">'
            + (f'<rect class="rowbg" x="0" y="{y}" width="{_W}" height="{row_h - 2}"/>' if i % 2 else "")
            + f'<text x="4" y="{y + 15}" class="label"><title>{_e(label)}, detected {_e(_clock(t0))}</title>'
            f"{_e(_short(label, label_w // 6))}</text>"
        )
        for stage, a, b in spans:
            if stage is LadderStage.CLOSED:
                continue
            xa = x0 + plot_w * min(1.0, (a - t0) / scale)
            xb = x0 + plot_w * min(1.0, (b - t0) / scale)
            tip = f"{stage.value}: {_duration(b - a)} ({_clock(a)} .. {_clock(b)})"
            svg.append(
                f'<rect class="bar stage-{stage.value}" data-stage="{stage.value}" data-start="{a:.3f}" '
                f'x="{xa:.1f}" y="{y + 3}" width="{max(xb - xa, 1.5):.1f}" height="{row_h - 8}">'
                f"<title>{_e(tip)}</title></rect>"
            )
        end_text = _duration(total) + (" (open)" if inc.is_open else "")
        if total > scale:
            end_text, cls = "» " + end_text, ' class="clipped"'
        else:
            cls = ""
        x_end = x0 + plot_w * min(1.0, total / scale) + 4
        svg.append(f'<text x="{x_end:.1f}" y="{y + 15}"{cls}>{_e(end_text)}</text></g>')
    axis_y = top + row_h * len(rows) + 2
    parts = [f'<g class="axis d-axis"><line x1="{x0}" y1="{axis_y}" x2="{x0 + plot_w}" y2="{axis_y}"/>']
    for t in duration_ticks(scale):
        x = x0 + plot_w * t / scale
        parts.append(f'<line class="grid" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{axis_y}"/>')
        parts.append(f'<text x="{x:.1f}" y="{axis_y + 14}" text-anchor="middle">{_e(_duration(t))}</text>')
    parts.append(
        f'<text class="label" x="{x0 + plot_w / 2}" y="{axis_y + 32}" text-anchor="middle">'
        "time since detection</text></g>"
    )
    svg.append("".join(parts))
    svg.append("</svg>")
    out.append("".join(svg))
    out.append(_legend((f"stage-{s.value}", s.value) for s in LadderStage if s is not LadderStage.CLOSED))
    out.append(
        f'<p class="note">unicornd\'s state holds open incidents and those closed within '
        f"{_e(_duration(KEEP_CLOSED_S))}; older ones stay in its incidents stream only.</p>"
    )
    if longest > scale:
        out.append(
            f'<p class="note">Bars are clipped at {_e(_duration(scale))} (four times the median '
            f"incident) so short incidents stay readable; » marks a longer one.</p>"
        )
    table_rows = []
    for (inc, spans), total in zip(rows, totals, strict=True):
        t0 = begin(spans, inc)
        table_rows.append(
            [
                inc.incident_id,
                _task_label(snap, inc.task_id) if inc.task_id else "-",
                inc.node,
                inc.status.value,
                inc.severity.value,
                inc.stage.value,
                _clock(t0),
                _duration(total) + (" (open)" if inc.is_open else ""),
                inc.confirmed_by or "",
                ", ".join(inc.isolated_nodes),
                _short(inc.note or inc.evidence, 160),
            ]
        )
    head = [
        "incident",
        "task",
        "node",
        "status",
        "severity",
        "stage",
        "detected",
        "lasted",
        "confirmed by",
        "drained",
        "note / evidence",
    ]
    out.append(_table("incidents", head, table_rows))
    return "".join(out)


@dataclass(frozen=True)
class _Plot:
    """A plot area: x0, y0 (top left), width, height; ``top``: the value at its top."""

    x0: float
    y0: float
    w: float
    h: float
    top: float

    def y(self, v: float) -> float:
        return self.y0 + self.h - self.h * v / self.top


def _steps(series: Sequence[WafSample], attr: str, win: Window, until: float, plot: _Plot) -> str:
    """Polyline points of a step function of ``series`` over the window (each sample in
    force until the next one, the last until ``until``)."""
    pts: list[str] = []
    for i, s in enumerate(series):
        end = series[i + 1].t_s if i + 1 < len(series) else until
        a, b = max(s.t_s, win.start_s), min(end, win.end_s)
        if b < a:
            continue
        y = plot.y(float(getattr(s, attr)))
        pts.append(f"{win.x(a, plot.x0, plot.w):.1f},{y:.1f}")
        pts.append(f"{win.x(b, plot.x0, plot.w):.1f},{y:.1f}")
    return " ".join(pts)


def _waf_section(ledger: Ledger | None, incidents: list[Incident], win: Window) -> str:
    out = ['<h2 id="waf-title">Achieved vs ideal WAF</h2>']
    if ledger is None:
        return out[0] + '<p class="note">unicornd keeps no goodput ledger yet.</p>'
    series = [
        s
        for i, s in enumerate(ledger.series)
        if s.t_s <= win.end_s and (i + 1 == len(ledger.series) or ledger.series[i + 1].t_s > win.start_s)
    ]
    ideal_now, achieved_now = ledger.ideal_wtflops(), ledger.achieved_wtflops()
    out.append(
        f'<p class="meta">Now: achieved {_e(_num(achieved_now))} of ideal {_e(_num(ideal_now))} weighted '
        f"TFLOP/s ({_e(_pct(achieved_now, ideal_now))}). Samples every ≥10 s while unicornd commits "
        f"({len(ledger.series)} kept, older ones thinned); the ledger is booked up to "
        f"{_e(_clock(ledger.t_s))}.</p>"
    )
    x0, y0, plot_w, plot_h = 70, 12, _W - 90, 240
    height = y0 + plot_h + 48
    top = nice_ticks(max([s.ideal for s in series] + [s.achieved for s in series] + [0.0]))[-1]
    svg = [
        f'<svg id="waf" viewBox="0 0 {_W} {height}" role="img" aria-label="Achieved and ideal WAF over time">'
    ]
    ticks = nice_ticks(top)
    axis = [f'<g class="axis y-axis"><line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 + plot_h}"/>']
    for v in ticks:
        y = y0 + plot_h - plot_h * v / top
        axis.append(f'<line class="grid" x1="{x0}" y1="{y:.1f}" x2="{x0 + plot_w}" y2="{y:.1f}"/>')
        axis.append(f'<line class="tick" x1="{x0 - 4}" y1="{y:.1f}" x2="{x0}" y2="{y:.1f}"/>')
        axis.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(_num(v))}</text>')
    axis.append(
        f'<text class="label" transform="translate(14 {y0 + plot_h / 2}) rotate(-90)" text-anchor="middle">'
        "weighted TFLOP/s</text></g>"
    )
    svg.append("".join(axis))
    svg.append(_time_axis(win, x0, plot_w, y0 + plot_h, grid_top=y0))
    svg.append(
        f'<text class="label" x="{x0 + plot_w / 2}" y="{y0 + plot_h + 34}" text-anchor="middle">'
        "time (local)</text>"
    )
    for inc in incidents:
        t = inc.timeline[0].t_s if inc.timeline else inc.opened_s
        if win.start_s <= t <= win.end_s:
            x = win.x(t, x0, plot_w)
            svg.append(
                f'<line class="incident-mark" x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + plot_h}">'
                f"<title>{_e(inc.incident_id)} detected {_e(_clock(t))}</title></line>"
            )
    until = ledger.t_s
    for attr, name in (("ideal", "ideal"), ("achieved", "achieved")):
        pts = _steps(series, attr, win, until, _Plot(x0, y0, plot_w, plot_h, top))
        svg.append(f'<polyline id="waf-{name}" class="series {name}" points="{pts}"/>')
    if not series:
        svg.append(
            f'<text x="{x0 + plot_w / 2}" y="{y0 + plot_h / 2}" text-anchor="middle">'
            "no WAF samples in this window</text>"
        )
    svg.append("</svg>")
    out.append("".join(svg))
    out.append(
        '<ul class="legend"><li><span class="swatch dash-ideal"></span>ideal W* (best failure-free plan, '
        'calibrated)</li><li><span class="swatch dash-achieved"></span>achieved (measured iterations)</li>'
        '<li><span class="swatch stage-detected"></span>incident detected</li></ul>'
    )
    return "".join(out)


def _causes_section(ledger: Ledger | None, win: Window) -> str:
    out = ['<h2 id="causes-title">Lost work by cause</h2>']
    if ledger is None:
        return out[0] + '<p class="note">unicornd keeps no goodput ledger yet.</p>'
    start, tot, tasks = ledger.since(win.start_s)
    out.append(
        f'<p class="meta">From {_e(_clock(start))} (the newest hourly checkpoint at or before the window '
        f"start) to {_e(_clock(ledger.t_s))}. Work in weighted TFLOP-hours (wTFLOP-h), time in GPU-hours.</p>"
    )
    gap = tot.ideal_wtflop - tot.achieved_wtflop
    rows = [
        ["ideal", _n(_num(tot.ideal_wtflop / 3600)), _n("100.0%"), _n(""), _n(_num(tot.gpu_s / 3600))],
        [
            "achieved",
            _n(_num(tot.achieved_wtflop / 3600)),
            _n(_pct(tot.achieved_wtflop, tot.ideal_wtflop)),
            _n(""),
            _n(_num(tot.productive_gpu_s / 3600)),
        ],
        ["gap", _n(_num(gap / 3600)), _n(_pct(gap, tot.ideal_wtflop)), _n("100.0%" if gap else "-"), _n("")],
    ]
    for c in Cause:
        v = tot.lost_wtflop.get(c, 0.0)
        rows.append(
            [
                f"lost: {c.value}",
                _n(_num(v / 3600)),
                _n(_pct(v, tot.ideal_wtflop)),
                _n(_pct(v, gap)),
                _n(_num(tot.lost_gpu_s.get(c, 0.0) / 3600)),
            ]
        )
    rows.append(
        [
            "unattributed (since each task's last iteration)",
            _n(_num(tot.unattributed_wtflop / 3600)),
            _n(_pct(tot.unattributed_wtflop, tot.ideal_wtflop)),
            _n(_pct(tot.unattributed_wtflop, gap)),
            _n(_num(tot.unattributed_gpu_s / 3600)),
        ]
    )
    out.append(_table("causes", ["", "wTFLOP-h", "of ideal", "of gap", "GPU-h"], rows))
    out.append(_stacked_bar(tot))
    trows = []
    for tid, t in sorted(tasks.items()):
        trows.append(
            [
                tid,
                _n(_num(t.ideal_wtflop / 3600)),
                _n(_pct(t.achieved_wtflop, t.ideal_wtflop)),
                _n(_pct(t.ideal_wtflop - t.achieved_wtflop, t.ideal_wtflop)),
                *(_n(_pct(t.lost_wtflop.get(c, 0.0), t.ideal_wtflop)) for c in Cause),
            ]
        )
    head = ["task", "ideal wTFLOP-h", "achieved", "gap", *(c.value for c in Cause)]
    out.append(_table("task-goodput", head, trows))
    return "".join(out)


def _stacked_bar(tot: Totals) -> str:
    """The ideal as one bar: achieved, each cause and the unattributed rest (parts below 0,
    e.g. a task faster than its calibration, are left out of the bar; the table has them)."""
    parts = [("achieved-work", "achieved", tot.achieved_wtflop)]
    parts += [(f"cause-{c.value}", c.value, tot.lost_wtflop.get(c, 0.0)) for c in Cause]
    parts.append(("unattributed-work", "unattributed", tot.unattributed_wtflop))
    positive = [(cls, name, v) for cls, name, v in parts if v > 0]
    whole = sum(v for _, _, v in positive)
    x0, w, h = 10, _W - 20, 28
    svg = [f'<svg id="lost" viewBox="0 0 {_W} {h + 6}" role="img" aria-label="Where the ideal work went">']
    x = float(x0)
    for cls, name, v in positive:
        width = w * v / whole
        svg.append(
            f'<rect class="part {cls}" data-part="{_e(name)}" x="{x:.1f}" y="3" width="{width:.1f}" '
            f'height="{h}"><title>{_e(name)}: {_e(_num(v / 3600))} wTFLOP-h '
            f"({_e(_pct(v, whole))})</title></rect>"
        )
        if width > 7 * len(name) + 6:
            svg.append(f'<text x="{x + 3:.1f}" y="{h / 2 + 7:.1f}">{_e(name)}</text>')
        x += width
    if not positive:
        svg.append(f'<text x="{x0}" y="{h / 2 + 7}">nothing booked yet</text>')
    svg.append("</svg>")
    legend = _legend((cls, name) for cls, name, _ in parts)
    return "".join(svg) + legend


def _summary(snap: Snapshot, incidents: list[Incident]) -> str:
    nodes = list(snap.nodes.values())
    out_nodes = sum(1 for n in nodes if n.health is not NodeHealth.HEALTHY or n.held)
    foreign = sum(1 for n in nodes if snap.foreign_jobs(n.name))
    by_state: dict[str, int] = {}
    for t in snap.tasks.values():
        by_state[t.state.value] = by_state.get(t.state.value, 0) + 1
    states = ", ".join(f"{n} {s}" for s, n in sorted(by_state.items())) or "none"
    open_incidents = sum(1 for i in snap.incidents.values() if i.is_open)
    return (
        f'<p class="meta" id="summary">{len(nodes)} nodes ({len(nodes) - out_nodes} healthy, '
        f"{out_nodes} out, "
        f"{foreign} not ours) of {snap.gpus_per_node} GPUs each · {len(snap.tasks)} tasks ({_e(states)}) · "
        f"incidents: {open_incidents} open, {len(incidents)} in the window · plan generation "
        f"{snap.plan_generation}</p>"
    )


def window(ledger: Ledger | None, snap: Snapshot, now_s: float, since_s: float | None) -> Window:
    """The window a report covers: the last ``since_s`` seconds, else all the ledger keeps
    (since it started, at most :data:`~unicornd.goodput.HISTORY_KEEP_S`; without a ledger:
    since the oldest incident, else the last hour); at least a minute."""
    if since_s is not None:
        start = now_s - since_s
    elif ledger is not None:
        start = max(ledger.started_s, now_s - HISTORY_KEEP_S)
    else:
        opened = [i.opened_s for i in snap.incidents.values()]
        start = min(opened, default=now_s - 3600.0)
    return Window(min(start, now_s - 60.0), now_s)


def render_html(
    snap: Snapshot,
    ledger: Ledger | None,
    now_s: float,
    since_s: float | None = None,
    *,
    gpu_type: str | None = None,
) -> str:
    """The report page (see the module docstring) for ``snap`` and ``ledger`` at ``now_s``,
    covering the last ``since_s`` seconds (None: all the ledger holds). ``gpu_type``: the
    nodes' GPU type as configured (None: unknown). Raises nothing for any valid state."""
    win = window(ledger, snap, now_s, since_s)
    incidents = incidents_in(snap, win.start_s, now_s)
    span = f"{_clock(win.start_s)} .. {_clock(win.end_s)} ({_duration(win.end_s - win.start_s)})"
    tz = time.strftime("%Z", time.localtime(now_s))
    body = [
        "<h1>unicorn cluster report</h1>",
        f'<p class="meta">Generated {_e(_clock(now_s))} ({_e(tz)}) from unicornd\'s state and goodput '
        f"ledger; window {_e(span)}.</p>",
        _summary(snap, incidents),
        _nodes_section(snap, gpu_type),
        _layouts_section(snap, ledger, win),
        _gantt_section(snap, incidents, now_s),
        _waf_section(ledger, incidents, win),
        _causes_section(ledger, win),
    ]
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8"/>'
        f'<meta http-equiv="Content-Security-Policy" content="{_e(CSP)}"/>'
        '<meta name="viewport" content="width=device-width, initial-scale=1"/>'
        '<link rel="icon" href="data:,"/>'
        f"<title>unicorn report {_e(_clock(now_s))}</title><style>{_css_classes()}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )
