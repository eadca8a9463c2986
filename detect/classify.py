"""Classify evidence (log lines, process exits, exceptions, GPU events) into Unicron statuses.

:func:`load_classifier` builds a :class:`Classifier` from the built-in rule table plus an
optional rules file (:mod:`detect.rules`). Every method is a pure function of its
arguments and the rules, and returns a :class:`Classification`; benign evidence gives
status ``none`` and severity ``None``.
"""

from __future__ import annotations

import json
import math
import re
import signal as signal_module
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from detect.builtin_rules import BUILTIN_RULES
from detect.isolation import Isolation, isolation_of
from detect.literals import Gate, NeedleSet, gates, lowered
from detect.nearest import TAIL_LINES, Nearest, NearestLines
from detect.nearest import builtin as builtin_nearest
from detect.origin import LAUNCHER_PREFIX, node_report
from detect.rules import Rule, RuleKind, load_rules_file, merge_rules, parse_rules
from detect.statuses import SECONDARY_BY_DEFAULT, ErrorStatus, Severity, worst
from detect.unraisable import IgnoredBlocks
from unicorn_core.errors import InvalidArgument
from unicorn_core.protocol import GpuFaultKind

MAX_LINE_CHARS: Final = 8192
"""Only this many leading characters of a line are matched, so one pathological line
(a rank printing a megabyte without a newline) costs bounded time."""
EVIDENCE_CHARS: Final = 1000
"""Evidence is cut to this many characters (the line that matched, or a summary)."""

_XID = re.compile(r"\bXID\b\s*(?:\([^)]*\))?\s*[:=]?\s*(\d{1,5})\b(?!, IRQ\b)", re.IGNORECASE)
"""The Xid code of a line: ``NVRM: Xid (PCI:0000:0a:00): 79, ...``, ``XID 48 ...``, ``Xid=79``; not a
Realtek NIC's chip revision at boot (``r8169 ... RTL8125B, <mac>, XID 641, IRQ 51``)."""
NEAREST_RULE: Final = "nearest_line"
"""The ``rule`` of a bare non-zero exit named by :mod:`detect.nearest`."""
_MAX_SIGNAL: Final = 64
_SIGNAL_EXIT_BASE: Final = 128


@dataclass(frozen=True)
class Classification:
    """What a piece of evidence means: Unicron status, severity, and which rule said so.

    ``severity`` is None exactly when ``status`` is ``none``. ``secondary`` marks
    evidence that is usually a consequence of a failure elsewhere (used by
    :func:`detect.rootcause.choose_root_cause`).
    """

    status: ErrorStatus
    severity: Severity | None
    rule: str
    evidence: str = ""
    secondary: bool = False

    def __post_init__(self) -> None:
        if (self.status is ErrorStatus.NONE) != (self.severity is None):
            raise InvalidArgument(
                f"status {self.status} with severity {self.severity}: only status none has no severity"
            )

    @property
    def is_fault(self) -> bool:
        return self.status is not ErrorStatus.NONE

    def to_json(self) -> dict[str, str | None]:
        """``{"status", "severity", "rule", "evidence"}`` with plain strings (severity None when benign)."""
        return {
            "status": self.status.value,
            "severity": self.severity.value if self.severity is not None else None,
            "rule": self.rule,
            "evidence": self.evidence,
        }


BENIGN: Final = Classification(ErrorStatus.NONE, None, "")
"""Evidence no rule matched."""


def _cut(text: str) -> str:
    text = text.strip()
    return text if len(text) <= EVIDENCE_CHARS else text[: EVIDENCE_CHARS - 3] + "..."


def _from_rule(rule: Rule, evidence: str) -> Classification:
    return Classification(rule.status, rule.severity, rule.name, _cut(evidence), rule.secondary)


def _signal_name(number: int) -> str:
    try:
        return signal_module.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class _Match:
    rule: Rule
    line: str
    position: int

    def key(self) -> tuple[bool, int, int]:
        """Specific before generic, then most severe, then earliest in the text."""
        assert self.rule.severity is not None
        return (self.rule.generic, self.rule.severity.level, self.position)


class _XidBlock:
    """Consecutive XID rules, indexed by code (the rules a code can match, in order)."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.catch_all = tuple(r for r in rules if not r.xids)
        codes = {code for r in rules for code in r.xids}
        self.by_code = {code: tuple(r for r in rules if not r.xids or code in r.xids) for code in codes}

    def find(self, code: int, line: str) -> Rule | None:
        """The first rule of the block for ``code`` whose message and veto agree with ``line``."""
        return next((r for r in self.by_code.get(code, self.catch_all) if r.matches_xid(code, line)), None)


_Step = tuple[tuple[Gate, ...], frozenset[str] | None, Rule | None, _XidBlock | None]
"""One step of line matching: (the rule's pattern as gated alternatives, the needles of
which one must be present (None: always try), the rule), or an Xid block."""


class Classifier:
    """Applies an ordered rule list; for each piece of evidence the first matching rule wins."""

    def __init__(
        self, rules: Sequence[Rule], *, prefilter: bool = True, nearest: NearestLines | None = None
    ) -> None:
        """``prefilter=False`` runs every line rule's regex on every line (for measurements).
        ``nearest``: labelled lines to name the cause of a bare non-zero exit
        (:mod:`detect.nearest`; :func:`detect.nearest.builtin` the packaged ones); None: never."""
        self.rules: tuple[Rule, ...] = tuple(rules)
        self._nearest = nearest
        self._xid_rules = tuple(r for r in self.rules if r.kind is RuleKind.XID)
        self._exit_rules = tuple(r for r in self.rules if r.kind is RuleKind.EXIT)
        self._exception_rules = tuple(r for r in self.rules if r.kind is RuleKind.EXCEPTION)
        self._gpu_rules = tuple(r for r in self.rules if r.kind is RuleKind.GPU)
        self._steps = _steps(self.rules, prefilter)
        self._needles = NeedleSet(n for step in self._steps for n, _ in step[0] if n is not None)

    def rule_named(self, name: str) -> Rule | None:
        """The rule called ``name`` (e.g. the ``rule`` of a ``FaultReport``), if this classifier has it."""
        return next((rule for rule in self.rules if rule.name == name), None)

    # --- log lines --------------------------------------------------------------------

    def _line_rule(self, line: str) -> Rule | None:
        prefix = LAUNCHER_PREFIX.match(line)  # rules read the rank's own line
        text = (line[prefix.end() :] if prefix is not None else line)[:MAX_LINE_CHARS]
        low = lowered(text)
        xid_match = _XID.search(text) if "xid" in low else None
        xid = int(xid_match.group(1)) if xid_match is not None else None
        present = self._needles.find(low)
        for parts, required, rule, block in self._steps:
            if block is not None:
                if xid is not None:
                    found = block.find(xid, text)
                    if found is not None:
                        return found
                continue
            assert rule is not None
            if required is not None and required.isdisjoint(present):
                continue  # none of the literals this pattern needs is in the line
            for needle, pattern in parts:
                if (needle is None or needle in present) and pattern.search(text):
                    if not rule.vetoed(text):
                        return rule
                    break
        return None

    def classify_line(self, line: str) -> Classification:
        """The first rule matching ``line`` (Xid lines by their code); ``none`` when no rule does."""
        rule = self._line_rule(line)
        return BENIGN if rule is None else _from_rule(rule, line)

    def _best(self, text: str, *, process_output: bool = False) -> _Match | None:
        """``process_output``: ``text`` is a process's own output, where a copy of a node's
        report (:func:`detect.origin.node_report`) is not evidence of how it ended."""
        best: _Match | None = None
        ignored = IgnoredBlocks()
        for position, line in enumerate(text.splitlines()):
            if ignored.inside(line):
                continue
            rule = self._line_rule(line)
            if rule is None or rule.status is ErrorStatus.NONE:
                continue
            if process_output and node_report(line) is not None:  # only for lines a rule matched
                continue
            match = _Match(rule, line, position)
            if best is None or match.key() < best.key():
                best = match
        return best

    def classify_text(self, text: str) -> Classification:
        """The most telling line classification in ``text``.

        Lines of Python's reports of ignored exceptions (:mod:`detect.unraisable`) are not
        evidence. A specific rule beats a generic catch-all (the final ``RuntimeError:`` or
        ``terminate called`` line of a crash only summarises a cause stated earlier);
        then the most severe wins; then the earliest line.
        """
        best = self._best(text)
        return BENIGN if best is None else _from_rule(best.rule, best.line)

    # --- process exits ----------------------------------------------------------------

    def classify_exit(
        self,
        exit_code: int | None,
        signal: int | None,
        stderr_tail: str = "",
        error_file_text: str | None = None,
    ) -> Classification:
        """Why a process ended, from its status and what it left behind.

        ``exit_code`` 0..255 or ``signal`` (never both; both None = unknown). An exit code
        128+N counts as signal N (a shell's way of reporting it). Exit 0 is benign.
        Otherwise the evidence in the torchelastic error file and the stderr tail names the
        cause when it can; an exit rule (e.g. SIGKILL) competes with it (non-secondary
        first, then more severe, ties to the text), and a bare non-zero exit is only the
        fallback. A process that is gone needs at least a restart, so the severity is at
        least ``SEV2`` even when the cause alone would be ``SEV3``. A bare exit whose output
        no rule matched may be named by the nearest labelled line (rule :data:`NEAREST_RULE`,
        always ``SEV2``: it names the cause, never escalates; see :mod:`detect.nearest`) when
        that status is one a node can cause (still isolated only on out-of-band
        confirmation, :mod:`detect.isolation`); a status that never isolates (the task's
        own code) is only a hint in the evidence of the bare exit: a guess never skips the
        node check that would find a bad node, nor ends a task.
        """
        _check_exit(exit_code, signal)
        if exit_code == 0:
            return Classification(ErrorStatus.NONE, None, "clean_exit", "exit code 0")
        number = signal
        if exit_code is not None and _SIGNAL_EXIT_BASE < exit_code <= _SIGNAL_EXIT_BASE + _MAX_SIGNAL:
            number = exit_code - _SIGNAL_EXIT_BASE
        ended = _ending(exit_code, number)

        texts = [*_error_file_texts(error_file_text), stderr_tail]
        found = self._best("\n".join(t for t in texts if t), process_output=True)
        exit_rule = next(
            (r for r in self._exit_rules if (number in r.signals) or (exit_code in r.exit_codes)),
            None,
        )
        floor = Severity.SEV2
        if exit_rule is not None and exit_rule.status is ErrorStatus.NONE:
            return _from_rule(exit_rule, ended)  # a rule that declares this ending expected
        if found is not None and (
            exit_rule is None or _weight(found.rule, floor) <= _weight(exit_rule, floor)
        ):
            rule = found.rule
            return Classification(
                rule.status,
                worst([rule.severity, floor]),
                rule.name,
                _cut(f"{ended}: {found.line.strip()}"),
                rule.secondary,
            )
        if exit_rule is not None:
            tail = f"; {found.line.strip()}" if found is not None else ""
            return Classification(
                exit_rule.status,
                worst([exit_rule.severity, floor]),
                exit_rule.name,
                _cut(ended + tail),
                exit_rule.secondary,
            )
        if number is not None:
            return Classification(ErrorStatus.EXITED_ABNORMALLY, Severity.SEV2, "killed_by_signal", ended)
        return self._bare_exit(ended, "exit_nonzero" if exit_code else "exit_status_unknown", texts)

    def _bare_exit(self, ended: str, rule: str, texts: Sequence[str]) -> Classification:
        """An exit nothing explains: ``exited_abnormally``, unless the nearest labelled line
        names a status a node can cause (see :meth:`classify_exit`)."""
        named = self._nearest_cause(texts)
        if named is None:
            return Classification(ErrorStatus.EXITED_ABNORMALLY, Severity.SEV2, rule, ended)
        hint = _cut(
            f"{ended}: {named.line.strip()} (no rule; nearest labelled line:"
            f" {named.status.value}, similarity {named.similarity:.2f})"
        )
        if isolation_of(named.status) is Isolation.NEVER:
            # A guess never ends a task as its own fault: the bare exit keeps its path (a
            # node check before anything isolates or stops the task), with the hint.
            return Classification(ErrorStatus.EXITED_ABNORMALLY, Severity.SEV2, rule, hint)
        secondary = named.status in SECONDARY_BY_DEFAULT
        return Classification(named.status, Severity.SEV2, NEAREST_RULE, hint, secondary)

    def _nearest_cause(self, texts: Sequence[str]) -> Nearest | None:
        """The status :mod:`detect.nearest` names from the last :data:`TAIL_LINES` of an
        exit's lines that no rule matched (not even a benign one), outside Python's reports
        of ignored exceptions and not copies of a node's report; None without labelled lines
        or when none is near enough."""
        index = self._nearest
        if index is None:
            return None
        ignored = IgnoredBlocks()
        kept = [line for t in texts for line in t.splitlines() if not ignored.inside(line) and line.strip()]
        unmatched = [line for line in kept if self._line_rule(line) is None and node_report(line) is None]
        tail = unmatched[-TAIL_LINES:]
        return index.name("\n".join(tail)) if tail else None

    # --- exceptions -------------------------------------------------------------------

    def classify_exception(self, exc_type: str, message: str, traceback: str = "") -> Classification:
        """An uncaught exception reported by the training hook.

        Exception rules match the type (and message) first; then the message and the
        traceback are classified as text (the most severe line wins, so a CUDA error deep
        in an exception chain is found); an exception nothing explains is
        ``other_software_error``.
        """
        name = exc_type.removeprefix("builtins.")
        summary = f"{name}: {message}" if message else name
        for rule in self._exception_rules:
            if rule.matches_exception(name, message):
                return _from_rule(rule, summary)
        found = self._best(f"{summary}\n{traceback}")
        if found is not None:
            return _from_rule(found.rule, found.line if found.position else summary)
        return Classification(
            ErrorStatus.OTHER_SOFTWARE_ERROR, Severity.SEV2, "uncaught_exception", _cut(summary)
        )

    # --- GPU health events ------------------------------------------------------------

    def classify_gpu(self, kind: GpuFaultKind, value: float) -> Classification:
        """An NVML health event: ``value`` is the Xid code, the counter, or degrees C."""
        if not math.isfinite(value):
            raise InvalidArgument(f"GPU event value must be finite, got {value}")
        kind = GpuFaultKind(kind)
        if kind is GpuFaultKind.XID:
            if value < 0 or value != int(value):
                raise InvalidArgument(f"an Xid code is a non-negative integer, got {value:g}")
            code = int(value)
            rule = next((r for r in self._xid_rules if r.matches_xid(code)), None)
            if rule is None or rule.status is ErrorStatus.NONE:
                return BENIGN
            return _from_rule(rule, f"xid = {code}" + (f": {rule.doc}" if rule.doc else ""))
        for rule in self._gpu_rules:
            if rule.gpu_kind is kind and value >= rule.min_value:
                return _from_rule(rule, f"{kind.value} = {value:g}" + (f": {rule.doc}" if rule.doc else ""))
        return BENIGN


def _check_exit(exit_code: int | None, signal: int | None) -> None:
    if exit_code is not None and signal is not None:
        raise InvalidArgument(f"exit_code and signal are exclusive, got {exit_code} and {signal}")
    if exit_code is not None and not 0 <= exit_code <= 255:
        raise InvalidArgument(f"exit_code must be in 0..255, got {exit_code}")
    if signal is not None and not 1 <= signal <= _MAX_SIGNAL:
        raise InvalidArgument(f"signal must be in 1..{_MAX_SIGNAL}, got {signal}")


def _ending(exit_code: int | None, number: int | None) -> str:
    """How the process ended, for evidence: ``killed by SIGKILL (exit code 137)``, ``exit code 1``."""
    if number is not None:
        return f"killed by {_signal_name(number)}" + (f" (exit code {exit_code})" if exit_code else "")
    return f"exit code {exit_code}" if exit_code is not None else "exit status unknown"


def _steps(rules: Sequence[Rule], prefilter: bool) -> tuple[_Step, ...]:
    """Line rules in order, each run of consecutive XID rules as one indexed block."""
    steps: list[_Step] = []
    run: list[Rule] = []
    for rule in (*rules, None):
        if rule is not None and rule.kind is RuleKind.XID:
            run.append(rule)
            continue
        if run:
            steps.append(((), None, None, _XidBlock(run)))
            run = []
        if rule is not None and rule.kind is RuleKind.LINE:
            assert rule.pattern is not None
            parts = gates(rule.pattern) if prefilter else ((None, rule.pattern),)
            found = [needle for needle, _ in parts]
            required = None if None in found else frozenset(n for n in found if n is not None)
            steps.append((parts, required, rule, None))
    return tuple(steps)


def _weight(rule: Rule, floor: Severity) -> tuple[bool, int]:
    """Primary before secondary, then more severe (severity raised to ``floor``); smaller wins."""
    assert rule.severity is not None
    return (rule.secondary, min(rule.severity.level, floor.level))


def _error_file_texts(text: str | None) -> list[str]:
    """The message and Python call stack of a torchelastic error file, else the raw text.

    The file is JSON: ``{"message": {"message": "...", "extraInfo": {"py_callstack":
    "..."}}}`` (older releases: ``{"message": "..."}``).
    """
    if not text:
        return []
    try:
        doc = json.loads(text)
    except ValueError:
        return [text]
    if not isinstance(doc, dict):
        return [text]
    message = doc.get("message")
    if isinstance(message, str):
        return [message]
    if isinstance(message, dict):
        found = [message["message"]] if isinstance(message.get("message"), str) else []
        extra = message.get("extraInfo")
        if isinstance(extra, dict) and isinstance(extra.get("py_callstack"), str):
            found.append(extra["py_callstack"])
        return found or [text]
    return [text]


def builtin_rules() -> tuple[Rule, ...]:
    """The built-in rule table, validated."""
    return parse_rules(BUILTIN_RULES, "built-in detect rules")


def load_classifier(rules_file: str | Path | None = None, *, nearest: bool = False) -> Classifier:
    """A classifier over the built-in rules, preceded by those of ``rules_file`` if given.

    A rule in the file with a built-in's name replaces it. A bad file raises
    ``ConfigError`` (naming the file, the rule and the reason) and nothing is built.
    ``nearest``: a bare non-zero exit is named from the packaged labelled lines
    (:mod:`detect.nearest`; ``[detect] nearest_lines``).
    """
    rules = builtin_rules()
    if rules_file:
        rules = merge_rules(load_rules_file(rules_file), rules)
    # read now: a bad data file fails at start-up, not at the first exit
    return Classifier(rules, nearest=builtin_nearest() if nearest else None)
