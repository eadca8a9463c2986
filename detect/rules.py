"""Classification rules as data: the schema, its validation, and rule files.

A rule maps one kind of evidence to an :class:`~detect.statuses.ErrorStatus`. The
built-in table (:mod:`detect.builtin_rules`) and rule files use the same schema, one
``[[rule]]`` table per rule, and go through the same parser::

    [[rule]]
    name = "fabric_manager_down"        # required, unique; reported as `rule`
    status = "gpu_driver_error"         # required: a Table 1 status, or "none" to silence
    severity = "SEV1"                   # optional; default: the status's Table 1 severity
    secondary = false                   # optional; default: true for nccl_timeout,
                                        #   connection_refused_reset and task_hang
    generic = false                     # optional: a catch-all; in a text any specific match wins
    doc = "why this evidence means that" # optional
    pattern = "Fabric Manager .* (?:not running|failed)"   # the matcher (see below)
    unless = '\\bwill retry\\b'             # optional veto (see below)
    ignore_case = true                  # optional, for pattern, message and unless

Exactly one matcher says what the rule looks at:

- ``pattern``: a regular expression searched in one log line;
- ``xid = [79, 95]``: NVIDIA Xid codes, from kernel lines ``NVRM: Xid (PCI:...): 79, ...``
  or NVML events; an empty list matches every Xid. With ``message = "..."`` (a regex
  searched in the Xid line) the rule matches only lines that say so, never a bare NVML
  event, which has no text (e.g. ``Fatal`` vs ``Nonfatal`` NVLink Xids);
- ``exit_codes = [42]`` and/or ``signals = ["SIGKILL", 11]``: how a process ended (an exit
  code 128+N from a shell counts as signal N);
- ``exception_type = "OutOfMemoryError"`` (a regex matched against the whole type name,
  with ``builtins.`` removed, or against its last dotted part), optionally with
  ``message = "..."`` (a regex searched in the exception message);
- ``gpu_kind = "temperature"`` with optional ``min_value = 90``: an NVML health event
  whose reading is at least ``min_value``.

``unless = "..."`` (pattern, xid and exception rules) is a veto: a regex searched in the
same text (the line, or the exception message); when it is found the rule does not match
and the next rules are tried. It states what makes matching text *not* evidence (a zero
count, a retry that follows), so the matcher can stay broad.

Order is priority: for each piece of evidence the first matching rule wins. Rules from a
file come before the built-ins; a file rule with a built-in's name replaces it. A rule
with status ``none`` that matches makes the evidence benign, so benign rules placed first
veto every rule after them (the built-ins start with such a group: log levels, zero
counts, retries, ignored exceptions).
"""

from __future__ import annotations

import enum
import math
import re
import signal as signal_module
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from detect.statuses import SECONDARY_BY_DEFAULT, ErrorStatus, Severity, default_severity
from unicorn_core.config import read_toml
from unicorn_core.errors import ConfigError
from unicorn_core.protocol import GpuFaultKind


class RuleKind(enum.StrEnum):
    """What evidence a rule looks at (decided by which matcher key it has)."""

    LINE = "line"
    XID = "xid"
    EXIT = "exit"
    EXCEPTION = "exception"
    GPU = "gpu"


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One validated rule; build with :func:`parse_rules`, never by hand."""

    name: str
    kind: RuleKind
    status: ErrorStatus
    severity: Severity | None
    """The severity it reports: the rule's own, else the status's Table 1 severity."""
    secondary: bool
    """Evidence usually caused by a failure elsewhere (see ``SECONDARY_BY_DEFAULT``)."""
    generic: bool
    """A catch-all: within one text, any specific match wins over it."""
    doc: str
    pattern: re.Pattern[str] | None = None
    """LINE: searched in the line. XID: searched in the Xid line, EXCEPTION: in the message
    (None: any)."""
    unless: re.Pattern[str] | None = None
    """A veto searched in the same text as ``pattern``: found means no match."""
    exception_type: re.Pattern[str] | None = None
    xids: frozenset[int] = frozenset()
    exit_codes: frozenset[int] = frozenset()
    signals: frozenset[int] = frozenset()
    gpu_kind: GpuFaultKind | None = None
    min_value: float = 0.0

    def matches_xid(self, code: int, line: str | None = None) -> bool:
        """XID rules: ``code`` is listed (or the rule lists none: a catch-all), and the
        rule's ``message`` is in ``line`` and its ``unless`` is not. ``line`` None is an
        NVML event without text: a rule that needs a message cannot match it."""
        if self.xids and code not in self.xids:
            return False
        if line is None:
            return self.pattern is None
        return (self.pattern is None or self.pattern.search(line) is not None) and not self.vetoed(line)

    def vetoed(self, text: str) -> bool:
        """The rule's ``unless`` is found in ``text``."""
        return self.unless is not None and self.unless.search(text) is not None

    def matches_exception(self, exc_type: str, message: str) -> bool:
        """EXCEPTION rules: the type matches (whole name or last part) and so does the message."""
        assert self.exception_type is not None
        name = exc_type.removeprefix("builtins.")
        short = name.rsplit(".", 1)[-1]
        if not (self.exception_type.fullmatch(name) or self.exception_type.fullmatch(short)):
            return False
        return (self.pattern is None or self.pattern.search(message) is not None) and not self.vetoed(message)


_COMMON_KEYS: Final = frozenset({"name", "status", "severity", "secondary", "generic", "doc"})
_KIND_KEYS: Final[dict[RuleKind, frozenset[str]]] = {
    RuleKind.LINE: frozenset({"pattern", "unless", "ignore_case"}),
    RuleKind.XID: frozenset({"xid", "message", "unless", "ignore_case"}),
    RuleKind.EXIT: frozenset({"exit_codes", "signals"}),
    RuleKind.EXCEPTION: frozenset({"exception_type", "message", "unless", "ignore_case"}),
    RuleKind.GPU: frozenset({"gpu_kind", "min_value"}),
}
_TRIGGERS: Final[dict[str, RuleKind]] = {
    "pattern": RuleKind.LINE,
    "xid": RuleKind.XID,
    "exit_codes": RuleKind.EXIT,
    "signals": RuleKind.EXIT,
    "exception_type": RuleKind.EXCEPTION,
    "gpu_kind": RuleKind.GPU,
}
_ALL_KEYS: Final = _COMMON_KEYS.union(*_KIND_KEYS.values())
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")
_MAX_SIGNAL: Final = 64


class _Problem(Exception):
    """One invalid key of one rule; collected, then reported together."""


def _str(table: Mapping[str, object], key: str, *, default: str | None = None) -> str:
    value = table.get(key, default)
    if not isinstance(value, str):
        raise _Problem(f"{key} must be a string, got {value!r}")
    return value


def _bool(table: Mapping[str, object], key: str, default: bool) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise _Problem(f"{key} must be true or false, got {value!r}")
    return value


def _regex(table: Mapping[str, object], key: str, flags: int) -> re.Pattern[str]:
    text = _str(table, key)
    if not text:
        raise _Problem(f"{key} must not be empty (it would match everything)")
    try:
        return re.compile(text, flags)
    except re.error as exc:
        raise _Problem(f"{key} {text!r} is not a valid regular expression: {exc}") from None


def _ints(table: Mapping[str, object], key: str, low: int, high: int) -> frozenset[int]:
    value = table.get(key, [])
    if not isinstance(value, list | tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in value
    ):
        raise _Problem(f"{key} must be a list of integers in {low}..{high}, got {value!r}")
    return frozenset(value)


def _signals(table: Mapping[str, object]) -> frozenset[int]:
    value = table.get("signals", [])
    if not isinstance(value, list | tuple):
        raise _Problem(f"signals must be a list of signal numbers or names, got {value!r}")
    found: set[int] = set()
    for item in value:
        if isinstance(item, int) and not isinstance(item, bool) and 1 <= item <= _MAX_SIGNAL:
            found.add(item)
            continue
        if isinstance(item, str):
            name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
            number = getattr(signal_module.Signals, name, None)
            if number is not None:
                found.add(int(number))
                continue
        raise _Problem(f"signals: {item!r} is not a signal number (1..{_MAX_SIGNAL}) or name (SIGKILL)")
    return frozenset(found)


def _kind(table: Mapping[str, object]) -> RuleKind:
    kinds = {kind for key, kind in _TRIGGERS.items() if key in table}
    if len(kinds) != 1:
        have = ", ".join(sorted(k for k in _TRIGGERS if k in table)) or "none"
        raise _Problem(
            "needs exactly one matcher (pattern, xid, exit_codes/signals, exception_type or "
            f"gpu_kind); has {have}"
        )
    return kinds.pop()


@dataclass(frozen=True)
class _Matcher:
    pattern: re.Pattern[str] | None = None
    unless: re.Pattern[str] | None = None
    exception_type: re.Pattern[str] | None = None
    xids: frozenset[int] = frozenset()
    exit_codes: frozenset[int] = frozenset()
    signals: frozenset[int] = frozenset()
    gpu_kind: GpuFaultKind | None = None
    min_value: float = 0.0


def _matcher(table: Mapping[str, object], kind: RuleKind) -> _Matcher:
    flags = re.IGNORECASE if _bool(table, "ignore_case", False) else 0
    unless = _regex(table, "unless", flags) if "unless" in table else None
    if kind is RuleKind.LINE:
        return _Matcher(pattern=_regex(table, "pattern", flags), unless=unless)
    if kind is RuleKind.XID:
        message = _regex(table, "message", flags) if "message" in table else None
        return _Matcher(pattern=message, unless=unless, xids=_ints(table, "xid", 0, 1 << 16))
    if kind is RuleKind.EXIT:
        matcher = _Matcher(exit_codes=_ints(table, "exit_codes", 1, 255), signals=_signals(table))
        if not matcher.exit_codes and not matcher.signals:
            raise _Problem("an exit rule needs at least one exit code or signal")
        return matcher
    if kind is RuleKind.EXCEPTION:
        message = _regex(table, "message", flags) if "message" in table else None
        return _Matcher(pattern=message, unless=unless, exception_type=_regex(table, "exception_type", 0))
    gpu_kind, min_value = _gpu(table)
    return _Matcher(gpu_kind=gpu_kind, min_value=min_value)


def _status(table: Mapping[str, object]) -> tuple[ErrorStatus, Severity | None]:
    text = _str(table, "status")
    try:
        status = ErrorStatus(text)
    except ValueError:
        raise _Problem(f"status {text!r} is not one of {', '.join(s.value for s in ErrorStatus)}") from None
    if "severity" not in table:
        return status, default_severity(status)
    severity_text = _str(table, "severity")
    if status is ErrorStatus.NONE:
        raise _Problem("a rule with status none has no severity")
    try:
        return status, Severity(severity_text)
    except ValueError:
        raise _Problem(f"severity {severity_text!r} is not one of SEV1, SEV2, SEV3") from None


def _rule(table: Mapping[str, object]) -> Rule:
    unknown = sorted(set(table) - _ALL_KEYS)
    if unknown:
        raise _Problem(f"unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(_ALL_KEYS))}")
    name = _str(table, "name")
    if not _NAME.fullmatch(name):
        raise _Problem(f"name {name!r} must start with a letter and hold only letters, digits, _ . -")
    kind = _kind(table)
    misplaced = sorted(set(table) - _COMMON_KEYS - _KIND_KEYS[kind])
    if misplaced:
        raise _Problem(f"key(s) {', '.join(misplaced)} do not apply to a {kind} rule")
    status, severity = _status(table)
    matcher = _matcher(table, kind)
    return Rule(
        name=name,
        kind=kind,
        status=status,
        severity=severity,
        secondary=_bool(table, "secondary", status in SECONDARY_BY_DEFAULT),
        generic=_bool(table, "generic", False),
        doc=_str(table, "doc", default=""),
        pattern=matcher.pattern,
        unless=matcher.unless,
        exception_type=matcher.exception_type,
        xids=matcher.xids,
        exit_codes=matcher.exit_codes,
        signals=matcher.signals,
        gpu_kind=matcher.gpu_kind,
        min_value=matcher.min_value,
    )


def _gpu(table: Mapping[str, object]) -> tuple[GpuFaultKind, float]:
    text = _str(table, "gpu_kind")
    try:
        kind = GpuFaultKind(text)
    except ValueError:
        raise _Problem(
            f"gpu_kind {text!r} is not one of {', '.join(k.value for k in GpuFaultKind)}"
        ) from None
    if kind is GpuFaultKind.XID:
        raise _Problem('gpu_kind "xid" is classified by xid rules; write xid = [...] instead')
    minimum = table.get("min_value", 0.0)
    if not isinstance(minimum, int | float) or isinstance(minimum, bool) or not math.isfinite(minimum):
        raise _Problem(f"min_value must be a number, got {minimum!r}")
    return kind, float(minimum)


def parse_rules(tables: Sequence[object], source: str) -> tuple[Rule, ...]:
    """Validate rule tables (the ``rule`` array of a rules file) in order.

    Raises ``ConfigError`` naming ``source``, each bad rule (position and name) and the
    reason; every problem is reported at once and no rule is returned.
    """
    rules: list[Rule] = []
    problems: list[str] = []
    seen: set[str] = set()
    for index, table in enumerate(tables, start=1):
        label = f"rule #{index}"
        if not isinstance(table, Mapping):
            problems.append(f"{label}: must be a table ([[rule]]), got {table!r}")
            continue
        if isinstance(table.get("name"), str):
            label += f" {table['name']!r}"
        try:
            rule = _rule(table)
        except _Problem as exc:
            problems.append(f"{label}: {exc}")
            continue
        if rule.name in seen:
            problems.append(f"{label}: name is used by an earlier rule")
            continue
        seen.add(rule.name)
        rules.append(rule)
    if problems:
        count = f"{len(problems)} problems: " if len(problems) > 1 else ""
        raise ConfigError(f"{source}: {count}" + "; ".join(problems))
    return tuple(rules)


def load_rules_file(path: str | Path) -> tuple[Rule, ...]:
    """Rules from a TOML file holding ``[[rule]]`` tables only (see module doc).

    Raises ``ConfigError`` naming the file (missing, unreadable, invalid TOML, a key
    other than ``rule``, or a bad rule).
    """
    path = Path(path)
    data = read_toml(path, "detect rules file")
    source = f"detect rules file {str(path)!r}"
    unknown = sorted(set(data) - {"rule"})
    if unknown:
        keys = ", ".join(unknown)
        raise ConfigError(f"{source}: unknown key(s) {keys}; a rules file holds only [[rule]] tables")
    tables = data.get("rule", [])
    if not isinstance(tables, list):
        raise ConfigError(f"{source}: rule must be an array of tables ([[rule]])")
    return parse_rules(tables, source)


def merge_rules(first: Sequence[Rule], then: Sequence[Rule]) -> tuple[Rule, ...]:
    """``first`` in order, then the rules of ``then`` whose names ``first`` does not take."""
    taken = {rule.name for rule in first}
    return (*first, *(rule for rule in then if rule.name not in taken))
