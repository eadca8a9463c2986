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
interleaved output of other ranks is still classified. A block ends at its exception line,
at the first line of its prefix that is not part of a traceback, or after
:data:`MAX_BLOCK_LINES` lines.
"""

from __future__ import annotations

import re
from typing import Final

MAX_BLOCK_LINES: Final = 200
"""A block longer than this is not Python's report (its tracebacks are a few dozen lines)."""
MAX_OPEN_BLOCKS: Final = 64
"""Prefixes followed at once (one per rank of the node is the most that makes sense)."""

_OPENING: Final = re.compile(r"Exception ignored (?:in|on calling)\b")
_HEADER: Final = "Traceback (most recent call last):"


class IgnoredBlocks:
    """Feed every line of one output stream, in order; :meth:`inside` says whether a line
    belongs to a report of an ignored exception (and so is not evidence of a failure)."""

    def __init__(self) -> None:
        self._open: dict[str, int] = {}  # prefix -> lines seen in its block

    def inside(self, line: str) -> bool:
        opening = _OPENING.search(line)
        if opening is not None:
            opened = line[: opening.start()]
            if opened in self._open or len(self._open) < MAX_OPEN_BLOCKS:
                self._open[opened] = 1
                return True
            return False
        prefix = self._prefix_of(line)
        if prefix is None:
            return False
        rest = line[len(prefix) :]
        count = self._open[prefix] + 1
        if count > MAX_BLOCK_LINES:
            del self._open[prefix]
            return False
        if rest.startswith(_HEADER) or (rest[:1].isspace() and rest.strip()):
            self._open[prefix] = count
            return True
        # The first line of the prefix that is not traceback is the exception line that ends
        # the report (right after the opening line when there was no traceback to print).
        del self._open[prefix]
        return bool(rest.strip())

    def _prefix_of(self, line: str) -> str | None:
        """The longest open block's prefix that ``line`` starts with."""
        best: str | None = None
        for prefix in self._open:
            if line.startswith(prefix) and (best is None or len(prefix) > len(best)):
                best = prefix
        return best
