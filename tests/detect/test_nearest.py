"""detect.nearest: the nearest labelled line names a bare exit's cause, and nothing else."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from detect.classify import NEAREST_RULE, Classifier, builtin_rules, load_classifier
from detect.isolation import Isolation, isolation_of
from detect.nearest import TAIL_LINES, NearestLines, builtin, dump, parse, tokens, words
from detect.origin import node_report
from detect.statuses import ErrorStatus, Severity
from tests.bench_script import load_bench
from unicorn_core.errors import InvalidArgument

REPO = Path(__file__).resolve().parents[2]

LABELLED = [
    ("ecc_error", "uncorrectable frobnicator parity fault on bank 7"),
    ("other_software_error", "widget loader gave up on the manifest"),
    ("nccl_timeout", "gizmo collective stalled waiting for peers"),
    ("none", "widget loader finished the manifest"),
]


def index() -> NearestLines:
    return NearestLines([tokens(words(t)) for _, t in LABELLED], [s for s, _ in LABELLED])


def classifier() -> Classifier:
    return Classifier(builtin_rules(), nearest=index())


def test_the_packaged_lines_are_current_and_never_the_blind_sets() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "corpus-nearest"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads((REPO / "detect" / "nearest_lines.json").read_text(encoding="utf-8"))
    bench = load_bench("classify")
    assert doc["sets"] == [n for n in bench.SETS if n != "held_out"]
    assert len(doc["lines"]) == len(builtin()) > 3000
    # Words, never the text: nothing upper-case, no punctuation.
    assert all(ws == " ".join(words(ws)) for _, ws in doc["lines"])


def test_the_nearest_line_and_its_similarity() -> None:
    n = index()
    exact = n.nearest(tokens(words("uncorrectable frobnicator parity fault on bank 7")))
    assert exact.status is ErrorStatus.ECC_ERROR and exact.similarity == pytest.approx(1.0)
    assert n.nearest(tokens(words("zzz qqq"))).status is ErrorStatus.NONE  # no known word
    assert n.nearest([]).similarity == 0.0


def test_name_takes_the_most_similar_error_line_and_ignores_benign_neighbours() -> None:
    n = index()
    assert n.name("widget loader finished the manifest") is None  # nearest a benign line
    assert n.name("completely unrelated words here") is None
    got = n.name("gizmo collective stalled\nwidget loader gave up on the manifest")
    assert got is not None and got.status is ErrorStatus.OTHER_SOFTWARE_ERROR
    assert got.line == "widget loader gave up on the manifest"
    assert n.name("gizmo collective stalled", threshold=1.01) is None  # not near enough


def test_the_review_s_cases_a_true_cosine_two_shared_words_and_ties_to_benign() -> None:
    """Found in review (session 33): a query was normalised over its known words only, so a
    line was judged on the words it shared (``ERROR`` alone named cuda_error at 0.41); one
    common word named a cause; a tie went to whichever line came first."""
    n = index()
    known = n.nearest(tokens(words("gizmo collective stalled")))
    padded = n.nearest(tokens(words("gizmo collective stalled qqq zzz www")))
    assert padded.similarity < known.similarity  # unknown words count in the norm
    assert known.shared == 3
    assert n.name("gizmo", threshold=0.0) is None  # one shared word names nothing
    assert n.name("gizmo collective", threshold=0.0) is not None
    tied = NearestLines([tokens(["alpha", "beta"])] * 2, ["ecc_error", "none"])
    assert tied.nearest(tokens(["alpha", "beta"])).status is ErrorStatus.NONE
    long_line = "gizmo collective stalled " + "ab " * 100_000  # read up to 8192 characters
    assert 2000 < len(words(long_line)) < 3000


def test_bad_data_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="unknown statuses"):
        dump([("melted", "some words")], ["train"])
    with pytest.raises(InvalidArgument, match="malformed"):
        parse("{not json")
    with pytest.raises(InvalidArgument, match="version"):
        parse('{"version": 99, "sets": [], "lines": []}')
    with pytest.raises(InvalidArgument):
        parse('{"version": 1, "sets": [], "lines": [["melted", "a b"]]}')
    with pytest.raises(InvalidArgument, match="labels"):
        NearestLines([["a"]], [])
    again = parse(dump(LABELLED, ["x"]))
    assert again.labels == index().labels


def test_a_bare_exit_takes_the_nearest_status_at_sev2_and_only_then() -> None:
    c = classifier()
    named = c.classify_exit(1, None, "step 3\nuncorrectable frobnicator parity fault on bank 2\n")
    assert (named.status, named.severity, named.rule) == (ErrorStatus.ECC_ERROR, Severity.SEV2, NEAREST_RULE)
    assert "exit code 1" in named.evidence and "frobnicator" in named.evidence
    assert "nearest labelled line: ecc_error" in named.evidence
    assert not named.secondary
    timeout = c.classify_exit(1, None, "gizmo collective stalled waiting for peers")
    assert timeout.status is ErrorStatus.NCCL_TIMEOUT and timeout.secondary  # a consequence, as its rules
    # A status that never isolates (the task's own code) is only a hint: a guess never skips
    # the node check a bare exit gets, nor ends the task.
    user = c.classify_exit(1, None, "widget loader gave up on the manifest")
    assert (user.status, user.severity, user.rule) == (
        ErrorStatus.EXITED_ABNORMALLY,
        Severity.SEV2,
        "exit_nonzero",
    )
    assert "nearest labelled line: other_software_error" in user.evidence
    # What no labelled error line is near stays a bare exit.
    assert c.classify_exit(1, None, "widget loader finished the manifest").rule == "exit_nonzero"
    assert c.classify_exit(1, None, "").rule == "exit_nonzero"
    # A rule's finding, an exit rule and a signal are never renamed.
    ruled = c.classify_exit(1, None, "uncorrectable frobnicator\nValueError: bad batch size")
    assert ruled.rule != NEAREST_RULE and ruled.status is ErrorStatus.OTHER_SOFTWARE_ERROR
    assert c.classify_exit(None, int(signal.SIGKILL), "gizmo collective stalled").rule == "killed_sigkill"
    # Only the last TAIL_LINES lines are read.
    old = "gizmo collective stalled waiting for peers\n" + "ok\n" * TAIL_LINES
    assert c.classify_exit(1, None, old).rule == "exit_nonzero"
    # Without labelled lines (Classifier's default) nothing changes.
    assert (
        Classifier(builtin_rules()).classify_exit(1, None, "gizmo collective stalled").rule == "exit_nonzero"
    )


def test_python_s_ignored_exception_reports_are_not_candidates() -> None:
    c = classifier()
    frame = "  gizmo collective stalled waiting for peers"  # a frame of the report: not evidence
    opening = "Exception ignored in: <function Widget.__del__ at 0x7f>"
    report = f"{opening}\nTraceback (most recent call last):\n{frame}\n"
    assert c.classify_exit(1, None, report).rule == "exit_nonzero"
    assert c.classify_exit(1, None, f"Traceback (most recent call last):\n{frame}\n").rule == NEAREST_RULE


def test_the_product_classifier_names_bare_exits_from_the_packaged_lines() -> None:
    """load_classifier with ``nearest`` (unicornd's ``[detect] nearest_lines``) reads the packaged
    lines: the exit of a rank whose
    last line is a labelled error line no rule matches gets that line's status (it is its own
    nearest line; a status that never isolates only as a hint), unless a line with the same
    words has another label; copies of a node's report in the output are never read."""
    c = load_classifier(None, nearest=True)
    bench = load_bench("classify")
    labels: dict[str, set[str]] = {}
    for _, ws in json.loads((REPO / "detect" / "nearest_lines.json").read_text(encoding="utf-8"))["lines"]:
        labels.setdefault(ws, set())
    for status, ws in json.loads((REPO / "detect" / "nearest_lines.json").read_text(encoding="utf-8"))[
        "lines"
    ]:
        labels[ws].add(status)
    unmatched = [
        line
        for name in bench.SETS
        if name != "held_out"
        for line in bench.load(bench.SETS[name][0])
        if c.classify_line(line.text).rule == "" and node_report(line.text) is None
    ]
    assert len(unmatched) >= 20
    for line in unmatched:
        got = c.classify_exit(1, None, f"step 9\n{line.text}\n")
        if labels[" ".join(words(line.text))] != {line.status}:
            continue
        assert f"nearest labelled line: {line.status}" in got.evidence, line.text
        if isolation_of(ErrorStatus(line.status)) is Isolation.NEVER:
            assert (got.rule, got.status) == ("exit_nonzero", ErrorStatus.EXITED_ABNORMALLY), line.text
        else:
            assert (got.rule, got.status.value) == (NEAREST_RULE, line.status), line.text
    assert c.classify_exit(3, None, "nothing here resembles anything qqq zzz").rule == "exit_nonzero"
    # Off by default (config): the same exits stay bare.
    off = load_classifier(None)
    assert {off.classify_exit(1, None, line.text).rule for line in unmatched} <= {"exit_nonzero"}
