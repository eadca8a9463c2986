"""Required literals of a regular expression: a cheap test before the regex itself.

Most log lines are benign, and Python's ``re`` tries every alternative at every position,
so ~60 rule patterns cost tens of microseconds per line. :func:`needles` finds, for a
pattern, a few lowercase strings of which at least one occurs in any text the pattern
matches. :class:`NeedleSet` finds which of all rules' needles occur in a line in one
pass, so a rule whose needles are all absent is skipped without running its regex, and
:func:`gates` splits a pattern so that only its alternatives whose needle is present run.

The analysis is conservative: it reads only literal characters at the top level of each
alternative, treats anything it does not understand as "no literal here", and returns
``None`` (always run the regex) when an alternative has no literal of at least
:data:`MIN_NEEDLE` characters or the pattern uses a construct it does not model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

MIN_NEEDLE: Final = 3
_CLASS_ESCAPES: Final = frozenset("bBdDsSwWAZ")
"""Escapes that are zero-width or a character class: they end a literal run."""
_OPTIONAL: Final = frozenset("*?{")
"""Quantifiers that may allow zero repetitions of the atom before them."""
_BOUND: Final = re.compile(r"\{\d*(?:,\d*)?\}")
_EDGE: Final = "".join(chr(c) for c in range(128) if not chr(c).isalnum())
"""ASCII characters trimmed from the ends of a needle (see :func:`_trimmed`)."""


def _split_alternatives(pattern: str) -> list[str] | None:
    """The top-level ``|`` alternatives of ``pattern``; None when brackets do not balance."""
    parts: list[str] = []
    depth, start, i, in_class = 0, 0, 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "^":
                i += 1
            if pattern[i + 1 : i + 2] == "]":  # a leading ] is a literal member
                i += 1
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                return None
        elif char == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    if depth != 0 or in_class:
        return None
    parts.append(pattern[start:])
    return parts


class _Unmodelled(Exception):
    """The pattern uses a construct :class:`_Runs` does not model."""


class _Runs:
    """Scans one alternative left to right, collecting literal runs at nesting depth 0."""

    def __init__(self, branch: str) -> None:
        self.branch = branch
        self.runs: list[str] = []
        self.run: list[str] = []
        self.depth = 0
        self.i = 0

    def close(self) -> None:
        if self.run:
            self.runs.append("".join(self.run))
            self.run.clear()

    def literal(self, char: str) -> None:
        """A literal atom: part of the run unless a quantifier makes it optional."""
        following = self.branch[self.i + 1 : self.i + 2]
        if following and following in _OPTIONAL:
            self.close()
        elif self.depth == 0:
            self.run.append(char)

    def escape(self) -> None:
        following = self.branch[self.i + 1 : self.i + 2]
        if not following:
            raise _Unmodelled
        self.i += 1
        if not following.isalnum():
            self.literal(following)
        elif following in _CLASS_ESCAPES:
            self.close()
        else:
            raise _Unmodelled  # \x41, \u..., \N{...}, back-references

    def char_class(self) -> None:
        """Skip ``[...]`` (a leading ``^`` and a first ``]`` belong to the class)."""
        self.close()
        self.i += 1
        if self.branch[self.i : self.i + 1] == "^":
            self.i += 1
        if self.branch[self.i : self.i + 1] == "]":
            self.i += 1
        while self.i < len(self.branch) and self.branch[self.i] != "]":
            self.i += 2 if self.branch[self.i] == "\\" else 1

    def optional(self, char: str) -> None:
        """``*``, ``?`` or ``{m,n}`` after an atom: the atom may be absent."""
        if self.run:
            self.run.pop()
        self.close()
        if char == "{":
            bound = _BOUND.match(self.branch, self.i)
            if bound is not None:
                self.i = bound.end() - 1  # the repetition count is not text

    def scan(self) -> list[str]:
        while self.i < len(self.branch):
            char = self.branch[self.i]
            if char == "\\":
                self.escape()
            elif char == "[":
                self.char_class()
            elif char in "()":
                self.close()
                self.depth += 1 if char == "(" else -1
            elif char in _OPTIONAL:
                self.optional(char)
            elif char in "+.^$":
                self.close()  # after "+" the atom is present but may repeat
            else:
                self.literal(char)
            self.i += 1
        self.close()
        return self.runs


_ASCII_FOLD: Final = str.maketrans({"\u0130": "i", "\u0131": "i", "\u017f": "s", "\u212a": "k"})
"""The only non-ASCII characters that ``re.IGNORECASE`` matches to ASCII letters (U+0130,
U+0131 dotted and dotless i, U+017F long s, U+212A Kelvin sign; see the ``re`` docs)."""


def lowered(text: str) -> str:
    """``text`` lowercased for needle tests: ``str.lower``, after mapping the four non-ASCII
    characters that an ignore-case pattern matches to ASCII letters onto those letters."""
    return text.lower() if text.isascii() else text.translate(_ASCII_FOLD).lower()


def needles(pattern: re.Pattern[str]) -> tuple[str, ...] | None:
    """Lowercase strings, one of which is in ``lowered(text)`` whenever ``pattern`` matches ``text``.

    ``None`` when no such set is known (the caller must always run the regex). An ASCII
    needle keeps the promise for an ``IGNORECASE`` pattern too, thanks to :func:`lowered`;
    a non-ASCII one may not (Unicode case folding), so callers trust ASCII needles only.
    """
    if pattern.flags & re.VERBOSE:
        return None
    alternatives = _split_alternatives(pattern.pattern)
    if alternatives is None:
        return None
    found: list[str] = []
    for branch in alternatives:
        try:
            runs = _Runs(branch).scan()
        except _Unmodelled:
            return None
        if not runs:
            return None
        best = max(runs, key=len)
        if len(best) < MIN_NEEDLE:
            return None
        found.append(_trimmed(best.lower()))
    return tuple(dict.fromkeys(found))


Gate = tuple[str | None, re.Pattern[str]]
"""An alternative of a pattern and its needle (None: no needle known, always try it)."""

_BACKREF: Final = re.compile(r"\\[1-9]|\(\?P=")
_INLINE_FLAGS: Final = re.compile(r"\(\?[aiLmsux-]+\)")


def gates(pattern: re.Pattern[str]) -> tuple[Gate, ...]:
    """``pattern`` as its top-level alternatives, each with its needle.

    ``pattern.search(text)`` finds a match exactly when one of the alternatives does, and an
    alternative can match only where its (lowercase, ASCII) needle is in ``lowered(text)``
    (the promise of :func:`needles`, one alternative at a time). So a caller tries only the
    alternatives whose needle is present, and a rule with twenty alternatives runs the one
    or two that can match instead of all twenty at every position. A pattern that cannot be
    split safely (verbose, inline flags, back-references, unbalanced) is one gate.
    """
    source = pattern.pattern
    branches = _split_alternatives(source)
    whole = needles(pattern)
    if (
        branches is None
        or len(branches) == 1
        or pattern.flags & re.VERBOSE
        or _BACKREF.search(source)
        or _INLINE_FLAGS.search(source)
    ):
        single = whole[0] if whole is not None and len(whole) == 1 and whole[0].isascii() else None
        return ((single, pattern),)
    flags = pattern.flags & ~re.UNICODE
    return tuple((_needle(branch), re.compile(branch, flags)) for branch in branches)


def _needle(branch: str) -> str | None:
    """The branch's longest top-level literal (lowercase, trimmed), if long enough and ASCII."""
    try:
        runs = _Runs(branch).scan()
    except _Unmodelled:
        return None
    best = max(runs, key=len, default="")
    needle = _trimmed(best.lower())
    return needle if len(best) >= MIN_NEEDLE and needle.isascii() else None


def _trimmed(needle: str) -> str:
    """``needle`` without leading and trailing punctuation or spaces, if as long as :data:`MIN_NEEDLE`.

    Any part of a required literal is required too; one that starts with a letter or digit
    lets :class:`NeedleSet` skip the many spaces and separators of a log line.
    """
    core = needle.strip(_EDGE)
    return core if len(core) >= MIN_NEEDLE else needle


class NeedleSet:
    """Which of many needles occur in a text, in one pass of one regular expression.

    Checking hundreds of needles one ``in`` at a time costs a Python-level loop per needle;
    here the needles form a trie, compiled to one regex whose alternatives branch on one
    character each, and a search from each position where some needle starts finds the
    longest needle there. Every needle that occurs is reported: the shorter needles that
    start at the same position are prefixes of the one found, and are added from a table.
    """

    def __init__(self, needles: Iterable[str]) -> None:
        self.needles = frozenset(n for n in needles if n)
        self._prefixes = {n: frozenset(p for p in self.needles if n.startswith(p)) for n in self.needles}
        self._search = re.compile(_trie(self.needles)).search if self.needles else None

    def find(self, text: str) -> set[str]:
        """The needles that occur in ``text`` (exactly ``{n for n in needles if n in text}``)."""
        found: set[str] = set()
        search = self._search
        if search is None:
            return found
        match = search(text)
        while match is not None:
            found |= self._prefixes[match.group()]
            match = search(text, match.start() + 1)
        return found


def _trie(words: Iterable[str]) -> str:
    """A regex matching exactly ``words``, longest first, as a trie of one-character branches."""
    root: dict[str, Any] = {}
    for word in words:
        node = root
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        branches = [re.escape(char) + build(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return build(root)
