"""``unicornctl report --html`` (issue 21): the page rendered from a scripted ten minutes
(:mod:`tests.unicornd.report_world`) parses, holds every node, incident and series,
escapes what the state holds and loads nothing; the ledger's WAF series and layout
histories stay bounded and old ledgers still decode; the command writes atomically; and
headless Chromium shows the page with its plots and no console message."""

from __future__ import annotations

import datetime as dt
import html
import itertools
import json
import re
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from PIL import Image

from detect.statuses import ErrorStatus, Severity
from tests.browser import chromium, open_in_chromium
from tests.unicornd.coord_world import task
from tests.unicornd.report_world import ASSUME, END, EVIL, GPU, T0, scripted, snapshot_at
from unicorn_core.keys import RedisKeys
from unicorn_core.logs import reset_logging
from unicornd.cli import cli
from unicornd.cli.report import write_atomically
from unicornd.goodput import (
    HISTORY_KEEP_S,
    LAYOUTS_KEEP,
    SERIES_EVERY_S,
    SERIES_MAX,
    LayoutChange,
    Ledger,
    WafSample,
    advance,
    decode,
    encode,
    record_layout,
    thin_series,
)
from unicornd.report import CSP, _duration, nice_ticks, render_html, time_ticks
from unicornd.state import Incident, LadderStage, Snapshot, StageEntry, TaskState
from unicornd.store import snapshot_to_json

World = tuple[Snapshot, Ledger, float]


@pytest.fixture(scope="module")
def world() -> World:
    return scripted()


@pytest.fixture(scope="module")
def page(world: World) -> str:
    snap, ledger, now = world
    return render_html(snap, ledger, now, gpu_type="a100-80g")


def _xml(page: str) -> ET.Element:
    """The page as XML (it is well-formed after the doctype)."""
    assert page.startswith("<!DOCTYPE html>\n")
    return ET.fromstring(page.removeprefix("<!DOCTYPE html>\n"))


def _by_id(root: ET.Element, ident: str) -> ET.Element:
    found = root.find(f".//*[@id='{ident}']")
    assert found is not None, ident
    return found


def _classes(el: ET.Element) -> set[str]:
    return set(el.get("class", "").split())


def _text(el: ET.Element) -> str:
    return "".join(el.itertext())


def _rows(table: ET.Element) -> list[list[str]]:
    return [[_text(td) for td in tr.findall("td")] for tr in table.findall("./tbody/tr")]


def _points(polyline: ET.Element) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in (p.split(",") for p in polyline.get("points", "").split())]


def _right_end(row: ET.Element) -> float:
    """Where the last bar of a Gantt row ends."""
    bars = [b for b in row.iter("rect") if "bar" in _classes(b)]
    return max(float(b.get("x", "")) + float(b.get("width", "")) for b in bars)


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs.extend(attrs)


def test_the_page_holds_every_node_with_its_task_and_owner(page: str) -> None:
    rows = {r[0]: r for r in _rows(_by_id(_xml(page), "nodes"))}
    assert sorted(rows) == ["n1", "n2", "n3", "n4", "n5"]
    head = ["node", "health", "reason", "GPUs", "GPU type", "task", "drained/held", "owner"]
    col = {h: i for i, h in enumerate(head)}
    assert rows["n1"][col["task"]] == "gpt7b" and rows["n3"][col["task"]] == "llama"
    assert rows["n2"][col["health"]] == "drained" and rows["n2"][col["drained/held"]].startswith("held")
    assert rows["n2"][col["reason"]] == "node unreachable <ssh>"  # escaped in the source, text here
    assert rows["n5"][col["owner"]] == "not ours (jobs 999)" and rows["n1"][col["owner"]] == "ours"
    assert {r[col["GPUs"]] for r in rows.values()} == {"2"} and rows["n4"][col["GPU type"]] == "a100-80g"


def test_the_gantt_has_a_row_per_incident_with_its_stages_in_time_order(page: str) -> None:
    gantt = _by_id(_xml(page), "gantt")
    rows = [g for g in gantt.iter("g") if "incident" in _classes(g)]
    assert [g.get("data-incident") for g in rows] == ["gpt7b.1", "llama.1", "llama.2"]
    expected = {
        "gpt7b.1": ["detected", "isolate", "replan", "transition", "resumed"],
        "llama.1": ["detected", "restart_processes", "resumed"],
        "llama.2": ["detected", "retry_in_place"],
    }
    for g in rows:
        bars = [r for r in g.iter("rect") if "bar" in _classes(r)]
        assert [b.get("data-stage") for b in bars] == expected[g.get("data-incident", "")]
        starts = [float(b.get("data-start", "")) for b in bars]
        xs = [float(b.get("x", "")) for b in bars]
        assert starts == sorted(starts) and xs == sorted(xs) and len(set(xs)) == len(xs)
        for b in bars:
            assert f"stage-{b.get('data-stage')}" in _classes(b) and float(b.get("width", "")) > 0
    label = _text(rows[0])
    assert all(part in label for part in ("gpt7b", "n2", "lost_connection", "SEV1", "closed"))
    assert "SEV3" in _text(rows[2]) and "(open)" in _text(rows[2])
    # gpt7b.1 lasted 30 s, llama.1 12 s, llama.2 is open for 40 s: the longest bar ends at the right.
    ends = [_right_end(g) for g in rows]
    assert ends[2] == pytest.approx(390 + 960 - 390 - 110) and ends[2] > ends[0] > ends[1]


def test_the_waf_chart_has_both_series_axes_and_ticks(page: str, world: World) -> None:
    _, ledger, _ = world
    waf = _by_id(_xml(page), "waf")
    ideal, achieved = _points(_by_id(waf, "waf-ideal")), _points(_by_id(waf, "waf-achieved"))
    assert len(ideal) == len(achieved) == 2 * len(ledger.series)
    for pts in (ideal, achieved):
        xs = [x for x, _ in pts]
        assert xs == sorted(xs) and xs[0] == pytest.approx(70) and xs[-1] == pytest.approx(70 + 960 - 90)
    # Each sample is a step at its value (y grows downwards from the top tick at y=12).
    top = nice_ticks(max(max(s.ideal, s.achieved) for s in ledger.series))[-1]
    for i, sample in enumerate(ledger.series):
        for pts, v in ((ideal, sample.ideal), (achieved, sample.achieved)):
            assert pts[2 * i][1] == pts[2 * i + 1][1] == pytest.approx(12 + 240 - 240 * v / top, abs=0.06)
    assert max(y for _, y in achieved[4:]) > max(y for _, y in ideal[4:])  # it drops during incidents
    texts = [_text(t) for t in waf.iter("text")]
    assert "weighted TFLOP/s" in texts and "time (local)" in texts
    ticks = [t for t in waf.iter("line") if "tick" in _classes(t)]
    assert len(ticks) >= 6
    marks = [m for m in waf.iter("line") if "incident-mark" in _classes(m)]
    assert len(marks) == 3


def test_lost_work_by_cause_and_layouts_are_shown(page: str) -> None:
    root = _xml(page)
    causes = [r[0] for r in _rows(_by_id(root, "causes"))]
    assert causes[:3] == ["ideal", "achieved", "gap"]
    for cause in ("detection", "decision_drain", "transition", "recomputation", "sub_healthy", "idle"):
        assert f"lost: {cause}" in causes
    parts = [r.get("data-part") for r in _by_id(root, "lost").iter("rect")]
    assert parts[0] == "achieved" and "detection" in parts
    history = _rows(_by_id(root, "layout-history"))
    gpt = [r for r in history if r[0] == "gpt7b"]
    assert [(r[3], r[4], r[5], r[6]) for r in gpt] == [
        ("running", "TP1 PP1 DP4", "4", "2"),
        ("recovering", "TP1 PP1 DP4", "4", "2"),
        ("recovering", "TP1 PP1 DP2", "2", "1"),
        ("running", "TP1 PP1 DP2", "2", "1"),
    ]
    assert gpt[0][7] == "+n1, +n2" and gpt[2][7] == "\N{MINUS SIGN}n2"
    # Each row lasts until the next one ("for"); the last one until now.
    starts = [dt.datetime.strptime(r[1], "%Y-%m-%d %H:%M:%S") for r in gpt]
    for row, a, b in zip(gpt, starts, starts[1:], strict=False):
        assert row[2] == _duration((b - a).total_seconds()), row
    assert gpt[-1][2].endswith(" (now)") and not any(r[2].endswith("(now)") for r in gpt[:-1])
    segs = [r for r in _by_id(root, "layouts").iter("rect") if r.get("data-task") == "gpt7b"]
    assert [s for s in segs if "state-recovering" in _classes(s)] and len(segs) == 4


def test_every_string_is_escaped_and_nothing_is_loaded(page: str) -> None:
    assert EVIL not in page and "<script" not in page.lower()
    assert html.escape(EVIL) in page
    assert "evidence &lt;&amp;&gt;" in page
    parser = _Tags()
    parser.feed(page)
    assert "script" not in parser.tags and "img" not in parser.tags and "iframe" not in parser.tags
    for bad in ("http://", "https://", "//", "url(", "@import"):
        assert bad not in page.replace("<!DOCTYPE", ""), bad
    names = {name for name, _ in parser.attrs}
    assert not names & {"src", "srcset", "action", "formaction", "background"}
    assert [v for n, v in parser.attrs if n == "href"] == ["data:,"]
    assert not [n for n in names if n.startswith("on")]  # no event handlers
    assert f'content="{html.escape(CSP)}"' in page and "default-src 'none'" in CSP


def test_since_narrows_the_window(world: World) -> None:
    snap, ledger, now = world
    root = _xml(render_html(snap, ledger, now, 120.0))
    gantt = _by_id(root, "gantt")
    assert [g.get("data-incident") for g in gantt.iter("g") if "incident" in _classes(g)] == ["llama.2"]
    xs = [x for x, _ in _points(_by_id(root, "waf-ideal"))]
    assert xs[0] == pytest.approx(70) and len(xs) == 2 * 13  # the sample in force at the start, 12 after
    history = _rows(_by_id(root, "layout-history"))
    assert {r[0] for r in history} == {"gpt7b", "llama", f"{EVIL} (c)"}
    assert [r[3] for r in history if r[0] == "llama"] == ["running", "recovering"]


def test_a_page_without_ledger_or_incidents_still_renders() -> None:
    page = render_html(snapshot_at(100.0), None, T0 + 100)
    root = _xml(page)
    assert "keeps no goodput ledger yet" in page and root.find(".//*[@id='waf']") is None
    assert len(_rows(_by_id(root, "nodes"))) == 5
    assert "no layout history recorded" in page and "No incidents in this window." in page


def test_a_long_incident_is_clipped_so_short_ones_stay_readable(world: World) -> None:
    """An idle node's incident escalated to the operator for 3 h beside the script's three
    (12-40 s): the scale is four times the median (120 s), the long bar ends at the right edge
    marked », and the short ones are still wide."""
    snap, ledger, now = world
    start = now - 3 * 3600
    stuck = Incident(
        "n4.1", None, "n4", None, ErrorStatus.ECC_ERROR, Severity.SEV1, "rule", "Xid 48", start,
        timeline=(StageEntry(LadderStage.DETECTED, start),),
    ).moved(LadderStage.ESCALATED_TO_OPERATOR, start + 5)  # fmt: skip
    root = _xml(render_html(snap.apply(incidents=[stuck]), ledger, now))
    rows = {g.get("data-incident"): g for g in _by_id(root, "gantt").iter("g") if "incident" in _classes(g)}
    assert next(iter(rows)) == "n4.1" and "(idle node)" in _text(rows["n4.1"])
    assert _right_end(rows["n4.1"]) == pytest.approx(390 + 960 - 390 - 110)
    assert "» 3h 00m (open)" in _text(rows["n4.1"])
    assert _right_end(rows["llama.1"]) - 390 > 40  # 12 s of 120 s
    assert "Bars are clipped at" in ET.tostring(root, encoding="unicode")


# --- bounded: the WAF series and the layout histories -----------------------------------------


def test_the_waf_series_stays_bounded_and_thins_its_older_half() -> None:
    series: list[WafSample] = []
    n = 100_000
    for i in range(n):
        t = T0 + SERIES_EVERY_S * i
        series = thin_series([*series, WafSample(t, 2.0, 1.0)], t)
        assert len(series) <= SERIES_MAX
    now = T0 + SERIES_EVERY_S * (n - 1)
    times = [s.t_s for s in series]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[-1] == now and times == sorted(times)
    assert all(g == SERIES_EVERY_S for g in gaps[-(SERIES_MAX // 2 - 1) :])  # the newest at full resolution
    assert max(gaps) >= 64 * SERIES_EVERY_S  # the oldest thinned many times
    assert now - times[0] <= HISTORY_KEEP_S and now - times[0] > SERIES_MAX * SERIES_EVERY_S
    assert len(encode(Ledger(t_s=now, started_s=T0, series=series))) < 80_000


def test_advance_samples_every_ten_seconds_within_the_cap(world: World) -> None:
    _, ledger, now = world
    full = [WafSample(now - SERIES_EVERY_S * (SERIES_MAX - i), 1.0, 1.0) for i in range(SERIES_MAX)]
    crowded = Ledger(**{**{f: getattr(ledger, f) for f in ledger.__struct_fields__}, "series": full})
    later = advance(crowded, snapshot_at(END), now + SERIES_EVERY_S, GPU, ASSUME)
    assert len(later.series) <= SERIES_MAX and later.series[-1].t_s == now + SERIES_EVERY_S
    assert later.series[-1].ideal == pytest.approx(later.ideal_wtflops(), rel=1e-6)
    sooner = advance(later, snapshot_at(END), now + SERIES_EVERY_S + 3, GPU, ASSUME)
    assert sooner.series is later.series  # no new sample within 10 s


def test_a_layout_history_keeps_the_last_changes_and_the_whole_node_list() -> None:
    history: list[LayoutChange] = []
    before: tuple[str, ...] = ()
    for i in range(1000):
        nodes = [f"n{j}" for j in range(i % 7, i % 7 + 3 + i % 2)]
        t = task("a", 1, nodes, state=TaskState.RUNNING if i % 3 else TaskState.RECOVERING)
        history = record_layout(history, before, t, 2 * len(nodes), T0 + i)
        before = t.nodes
        assert len(history) <= LAYOUTS_KEEP
        whole: list[str] = []
        for change in history:  # the node list, replayed from the changes
            whole = [n for n in whole if n not in change.removed] + list(change.added)
            assert change.nodes == len(whole)
        assert set(whole) == set(nodes)
    assert history[0].removed == () and history[-1].t_s == T0 + 999
    same = task("a", 1, list(before), state=history[-1].state)
    assert record_layout(history, before, same, 0, T0 + 2000) is history


def test_a_ledger_stored_before_the_series_and_histories_decodes(world: World) -> None:
    _, ledger, now = world
    doc = json.loads(encode(ledger))
    del doc["series"]
    for book in doc["tasks"].values():
        del book["nodes"], book["layouts"]
    old = decode(json.dumps(doc).encode())
    assert old.series == [] and all(b.layouts == [] and b.nodes == () for b in old.tasks.values())
    assert "no WAF samples in this window" in render_html(snapshot_at(END), old, now)
    later = advance(old, snapshot_at(END), now + 1, GPU, ASSUME)
    assert len(later.series) == 1
    (first,) = later.tasks["gpt7b"].layouts
    assert first.added == ("n1",) and first.state is TaskState.RUNNING
    assert decode(encode(later)) == later


# --- the command ------------------------------------------------------------------------------


@pytest.fixture
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="unicorn-report-") as d:
        yield Path(d)


def test_write_atomically_replaces_the_file_and_leaves_no_temporary(folder: Path) -> None:
    target = folder / "r.html"
    target.write_text("old")
    target.chmod(0o640)
    write_atomically(target, b"new")
    assert target.read_bytes() == b"new" and target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in folder.iterdir()) == ["r.html"]
    with pytest.raises(OSError):
        write_atomically(folder / "missing" / "r.html", b"x")
    assert sorted(p.name for p in folder.iterdir()) == ["r.html"]


def test_report_cli_writes_the_page_and_says_what_it_does(redis_url: str, folder: Path, world: World) -> None:
    reset_logging()
    snap, ledger, _ = world
    prefix = "reporttest"
    env = {
        "UNICORN_REDIS__URL": redis_url,
        "UNICORN_REDIS__KEY_PREFIX": prefix,
        "UNICORN_REDIS__PASSWORD_FILE": "",
        "UNICORN_CONFIG": "",
    }
    runner = CliRunner()
    target = folder / "report.html"
    usage = runner.invoke(cli, ["report"], env=env)
    assert usage.exit_code == 2 and "--html" in usage.stderr
    bad = runner.invoke(cli, ["report", "--html", str(target), "--since", "soon"], env=env)
    assert bad.exit_code == 2 and "not a duration" in bad.stderr
    none = runner.invoke(cli, ["report", "--html", str(target)], env=env)
    assert none.exit_code == 3 and not target.exists()
    admin = redis.Redis.from_url(redis_url)
    keys = RedisKeys(prefix)
    admin.set(keys.state(), snapshot_to_json(snap))
    no_ledger = runner.invoke(cli, ["report", "--html", str(target)], env=env)
    assert no_ledger.exit_code == 0, no_ledger.output
    assert "keeps no goodput ledger yet" in target.read_text()
    admin.set(keys.goodput(), encode(ledger))
    done = runner.invoke(cli, ["report", "--html", str(target), "--since", "7d"], env=env)
    assert done.exit_code == 0, done.output
    page = target.read_text()
    assert 'id="waf-achieved"' in page and 'id="gantt"' in page
    lines = done.stderr.splitlines()
    assert [ln.split(" ")[1] for ln in lines if ln.startswith("report: ")] == [
        "reading",
        "rendering",
        "wrote",
    ]
    assert f"wrote {len(page.encode())} bytes to {target}" in done.stderr
    assert "5 nodes, 3 tasks" in done.stderr and done.stdout == ""
    assert sorted(p.name for p in folder.iterdir()) == ["report.html"]
    out = runner.invoke(cli, ["report", "--html", "-"], env=env)
    assert out.exit_code == 0 and out.stdout.startswith("<!DOCTYPE html>") and "to stdout" in out.stderr
    admin.set(keys.goodput(), b"{}")
    broken = runner.invoke(cli, ["report", "--html", str(target)], env=env)
    assert broken.exit_code == 1 and "goodput ledger" in broken.stderr
    assert target.read_text() == page  # unchanged


# --- axes -------------------------------------------------------------------------------------


def test_axis_ticks_are_round() -> None:
    assert nice_ticks(1.033) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert nice_ticks(0.0) == [0.0, 1.0] and nice_ticks(480)[-1] == 500
    ticks, fmt = time_ticks(T0, T0 + 600)
    assert fmt == "%H:%M" and len(ticks) <= 6 and all(b - a == 120 for a, b in itertools.pairwise(ticks))
    _, fmt = time_ticks(T0, T0 + 7 * 86400)
    assert fmt == "%m-%d %H:%M"


# --- in a browser -----------------------------------------------------------------------------


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (scripts/dev-cluster install does)")
def test_chromium_shows_the_plots_and_logs_nothing(page: str, folder: Path) -> None:
    path = folder / "report.html"
    path.write_text(page, encoding="utf-8")
    with open_in_chromium(path, width=1280, height=2400) as shown:
        assert shown.console == (), shown.console
        with Image.open(shown.screenshot) as png:
            assert png.size == (1280, 2400)
            colours = png.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is not None and len(colours) > 20  # not blank: text, bars, lines
        dom = shown.dom
    for ident in ("gantt", "waf", "layouts", "lost", "nodes", "causes"):
        assert f'id="{ident}"' in dom, ident
    assert len(re.findall(r'<rect class="bar stage-', dom)) == 10
    assert re.search(r'<polyline id="waf-ideal" class="series ideal" points="[\d., ]+"', dom)
    assert re.search(r'<polyline id="waf-achieved" class="series achieved" points="[\d., ]+"', dom)
    assert sorted(p.name for p in folder.iterdir()) == ["report.html"]


def test_the_browser_helper_reports_console_errors(folder: Path) -> None:
    """The check above would see a broken page: a script error and a blocked load are
    console lines (so an empty list means something)."""
    if chromium() is None:
        pytest.skip("chromium is not installed (scripts/dev-cluster install does)")
    path = folder / "bad.html"
    path.write_text(
        f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" content="{CSP}"/></head>'
        '<body><p id="x">x</p><img src="https://example.invalid/a.png"/>'
        "<svg><rect width='9' height='9'/></svg></body></html>"
    )
    with open_in_chromium(path, width=200, height=100) as shown:
        assert any("example.invalid" in line for line in shown.console), shown.stderr
        assert '<p id="x">x</p>' in shown.dom
