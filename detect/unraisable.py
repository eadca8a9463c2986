"""Python's reports of exceptions, recognised across lines: those it ignored
(:class:`IgnoredBlocks`) and the tracebacks an exception line ends (:class:`Tracebacks`).

When an exception escapes ``__del__``, a weakref callback or an atexit handler, Python
prints it and carries on (``sys.unraisablehook``)::

    Exception ignored in: <function _MultiProcessingDataLoaderIter.__del__ at 0x7f...>
    Traceback (most recent call last):
      File ".../dataloader.py", line 1478, in __del__
        self._shutdown_workers()
    AttributeError: 'NoneType' object has no attribute 'python_exit_status'

The last line alone reads as a crash of the training code (SEV2: restart the job), but
nothing failed. Rules see one line at a time; :class:`IgnoredBlocks` follows the block
instead: the opening line, the traceback's header and its indented frames, and the
exception line that closes it are all inside. Launchers prefix every line of a rank
(``[rank3]:``, ``(RayWorker pid=12)``): the text before "Exception ignored in" on the
opening line is the block's prefix, and only lines with that prefix continue it, so
interleaved output of other ranks is still classified (an unprefixed report never takes a
rank-prefixed line). A block ends at its exception line, at the first line of its prefix
that is not part of a traceback (that line is classified as usual), or after
:data:`MAX_BLOCK_LINES` lines.
"""

from __future__ import annotations

import re
from typing import Final

from detect.origin import LAUNCHER_PREFIX  # a line a launcher prefixed: never part of an unprefixed report

MAX_BLOCK_LINES: Final = 200
"""A block longer than this is not Python's report (its tracebacks are a few dozen lines)."""
MAX_TRACEBACK_LINES: Final = 20_000
"""A traceback's lines before its exception line (3 a frame in Python 3.11+: deep stacks of
compiled or wrapped models run to thousands); past this it is given up."""
MAX_OPEN_BLOCKS: Final = 64
"""Prefixes followed at once; past this, the oldest open block is dropped."""

_OPENING: Final = re.compile(r"Exception ignored (?:in|on calling)\b")
_HEADER: Final = "Traceback (most recent call last):"
_EXCEPTION_LINE: Final = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Warning|Exit|Interrupt)\b")
"""The line that ends a report: the exception's (qualified) name, then its message."""


def _prefix_of(opened: dict[str, int], line: str) -> str | None:
    """The longest open block's prefix that ``line`` starts with (an unprefixed block never
    takes a line a launcher prefixed)."""
    best: str | None = None
    for prefix in opened:
        if not line.startswith(prefix) or (not prefix and LAUNCHER_PREFIX.match(line)):
            continue
        if best is None or len(prefix) > len(best):
            best = prefix
    return best


def _open_block(opened: dict[str, int], prefix: str) -> None:
    opened.pop(prefix, None)
    if len(opened) >= MAX_OPEN_BLOCKS:
        del opened[next(iter(opened))]  # the oldest
    opened[prefix] = 1


def _continued(opened: dict[str, int], line: str, limit: int) -> tuple[str, str, int] | None:
    """For a line of an open block's prefix: (its prefix, the rest of it, the block's line
    count with it), the block taken out of ``opened`` (the caller puts it back if the line
    continues it); None for a line of no open block, or one past ``limit`` lines (given up)."""
    prefix = _prefix_of(opened, line)
    if prefix is None:
        return None
    count = opened.pop(prefix) + 1
    return None if count > limit else (prefix, line[len(prefix) :], count)


class IgnoredBlocks:
    """Feed every line of one output stream, in order; :meth:`inside` says whether a line
    belongs to a report of an ignored exception (and so is not evidence of a failure).

    Only the report's own shape is consumed: the opening line, then the traceback's header
    and indented frames, then one exception line. Any other line of the prefix ends the
    block and is classified as usual, so a report cut short (its rank killed) hides
    nothing that follows it. An unprefixed report never takes a rank-prefixed line."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}  # prefix -> lines seen in its block

    def inside(self, line: str) -> bool:
        opening = _OPENING.search(line)
        if opening is not None:
            _open_block(self._open, line[: opening.start()])
            return True
        continued = _continued(self._open, line, MAX_BLOCK_LINES)
        if continued is None:
            return False
        prefix, rest, count = continued
        if rest.startswith(_HEADER) or (rest[:1].isspace() and rest.strip()):
            self._open[prefix] = count
            return True
        # The exception line ends the report (right after the opening line when there was
        # no traceback to print); anything else ends it too, and is not part of it.
        return _EXCEPTION_LINE.match(rest) is not None


EXCEPTION_LINE_RULES: Final = frozenset({"python_exception", "bare_exception", "arrow_exception"})
"""The built-in rules that read a line as an exception of no particular kind (the generic
ones); a specific rule (CUDA out of memory, an illegal address, NCCL's errors) names its
cause whatever printed it."""


_CLOSING_LINE: Final = re.compile(r"[A-Za-z_][\w.]*(?::\s|:?\s*$)")
"""The line Python ends a traceback with: the exception's qualified name, then ': message'
or nothing (whatever the name: 'pyarrow.lib.ArrowInvalid: ...', 'KeyboardInterrupt')."""


class Tracebacks:
    """Feed every line of one output stream, in order; :meth:`closes` says whether a line is
    the exception line that ends a traceback Python printed (its header, then indented
    frames, then ``Name: message`` with the header's prefix).

    An exception line that ends no traceback is text a program printed: a handler logging
    ``str(e)`` and going on, a thread's shutdown message, a model printing what it caught.
    An uncaught exception always comes with its traceback (Python's default hook, torchrun's
    ``[rankN]:`` prefix on every line of it), and the rank's exit is classified on its own.
    The agent therefore sends a generic exception line without a traceback at SEV3 (wait in
    place), not SEV2 (restart the job). Prefixes as in :class:`IgnoredBlocks`."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}  # prefix -> lines seen since its header

    def closes(self, line: str) -> bool:
        at = line.find(_HEADER)
        if at >= 0:
            _open_block(self._open, line[:at])
            return False
        continued = _continued(self._open, line, MAX_TRACEBACK_LINES)
        if continued is None:
            return False
        prefix, rest, count = continued
        if rest[:1].isspace() and rest.strip():
            self._open[prefix] = count  # a frame, its source line or a caret marker
            return False
        return _CLOSING_LINE.match(rest) is not None
