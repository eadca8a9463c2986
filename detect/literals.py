"""Required literals of a regular expression: a cheap test before the regex itself.

Most log lines are benign, and Python's ``re`` tries every alternative at every position,
so ~60 rule patterns cost tens of microseconds per line. :func:`needles` finds, for a
pattern, a few lowercase strings of which at least one occurs in any text the pattern
matches. ``needle in line.lower()`` is a fast C loop, so a rule whose needles are all
absent is skipped without running its regex.

The analysis is conservative: it reads only literal characters at the top level of each
alternative, treats anything it does not understand as "no literal here", and returns
``None`` (always run the regex) when an alternative has no literal of at least
:data:`MIN_NEEDLE` characters or the pattern uses a construct it does not model.
"""

from __future__ import annotations

import re
from typing import Final

MIN_NEEDLE: Final = 3
_CLASS_ESCAPES: Final = frozenset("bBdDsSwWAZ")
"""Escapes that are zero-width or a character class: they end a literal run."""
_OPTIONAL: Final = frozenset("*?{")
"""Quantifiers that may allow zero repetitions of the atom before them."""
_BOUND: Final = re.compile(r"\{\d*(?:,\d*)?\}")


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


def needles(pattern: re.Pattern[str]) -> tuple[str, ...] | None:
    """Lowercase strings, one of which is in ``text.lower()`` whenever ``pattern`` matches ``text``.

    ``None`` when no such set is known (the caller must always run the regex). For an
    ``IGNORECASE`` pattern the promise holds for ASCII text only: Unicode case folding can
    match characters that ``str.lower`` does not map (e.g. the Kelvin sign and ``k``).
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
        found.append(best.lower())
    return tuple(dict.fromkeys(found))
