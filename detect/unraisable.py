"""Python's reports of exceptions it ignored, recognised across lines.

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
MAX_OPEN_BLOCKS: Final = 64
"""Prefixes followed at once; past this, the oldest open block is dropped."""

_OPENING: Final = re.compile(r"Exception ignored (?:in|on calling)\b")
_HEADER: Final = "Traceback (most recent call last):"
_EXCEPTION_LINE: Final = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Warning|Exit|Interrupt)\b")
"""The line that ends a report: the exception's (qualified) name, then its message."""


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
            opened = line[: opening.start()]
            self._open.pop(opened, None)
            if len(self._open) >= MAX_OPEN_BLOCKS:
                del self._open[next(iter(self._open))]  # the oldest
            self._open[opened] = 1
            return True
        prefix = self._prefix_of(line)
        if prefix is None:
            return False
        rest = line[len(prefix) :]
        count = self._open.pop(prefix) + 1
        if count > MAX_BLOCK_LINES:
            return False
        if rest.startswith(_HEADER) or (rest[:1].isspace() and rest.strip()):
            self._open[prefix] = count
            return True
        # The exception line ends the report (right after the opening line when there was
        # no traceback to print); anything else ends it too, and is not part of it.
        return _EXCEPTION_LINE.match(rest) is not None

    def _prefix_of(self, line: str) -> str | None:
        """The longest open block's prefix that ``line`` starts with."""
        best: str | None = None
        for prefix in self._open:
            if not line.startswith(prefix) or (not prefix and LAUNCHER_PREFIX.match(line)):
                continue
            if best is None or len(prefix) > len(best):
                best = prefix
        return best
