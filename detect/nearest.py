"""The nearest labelled line: a cause for a non-zero exit that no rule explains (issue 17).

The rules (:mod:`detect.builtin_rules`) name the status of 0.63-0.80 of the error lines of
each new set of sources nobody here had read (BENCHMARKS.md). A rank that exits non-zero
with output no rule matches is then only ``exited_abnormally``. In the leave-one-set-out
measurement of ``scripts/bench/classify_learned.py`` the status of the most similar
labelled line (tf-idf cosine over words and word pairs) was right more often than the
rules on lines from unseen sources, but it also called benign lines failures. So it is
used only where a failure is already certain and unexplained:
:meth:`detect.classify.Classifier.classify_exit` asks it to *name* the cause of a bare
non-zero exit from the exit's own output. It never classifies a line on its own (a line
never opens an incident through it) and never raises the exit's severity (``SEV2``, see
there): it changes which status an incident reports, and so whether the task's own code
is to blame (:mod:`detect.isolation`: a status that never isolates) or a node could be
(still only after out-of-band confirmation).

The labelled lines are the corpus sets the rules may be written from (never the blind
set), as tokens, in ``detect/nearest_lines.json``: ``scripts/corpus-nearest`` writes it
and a test checks it is current.

Off by default (``[detect] nearest_lines``): on blind10 and blind11 it changed no exit's
status for the better (BENCHMARKS.md). Known weakness: a short line whose words all appear
in one labelled error line is near it, e.g. a banner ``nccl version 2.18.3`` and a
``... unhandled cuda error, NCCL version ...`` line.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Final

from detect.statuses import ErrorStatus
from unicorn_core.errors import InvalidArgument

DATA_VERSION: Final = 1
THRESHOLD: Final = 0.3
"""Least cosine similarity to name a status. Chosen on blind8 before blind9 and blind10 were
read (0.0: more right, 13 of 181 benign lines called failures; 0.5: 0 and fewer right)."""
TAIL_LINES: Final = 20
"""Lines of an exit's output read, from its end (the cause is printed last)."""
MIN_SHARED_WORDS: Final = 2
"""Distinct words (not numbers) a line must share with the labelled line that names it: one
common word ('ERROR', 'nccl') makes a short line look near a short labelled one."""

_TOKEN = re.compile(r"[a-z][a-z_]+|\d+")
_MAX_DIGITS = 3
_MAX_CHARS = 8192
"""Only this many leading characters of a line are read (as ``detect.classify.MAX_LINE_CHARS``)."""


def words(text: str) -> list[str]:
    """The lower-case words and numbers of ``text``; digit runs longer than 3 dropped
    (addresses, PIDs, timestamps say nothing about the cause)."""
    return [w for w in _TOKEN.findall(text[:_MAX_CHARS].lower()) if not w.isdigit() or len(w) <= _MAX_DIGITS]


def tokens(ws: Sequence[str]) -> list[str]:
    """Unigrams and bigrams of :func:`words`' output."""
    return [*ws, *(f"{a} {b}" for a, b in itertools.pairwise(ws))]


@dataclass(frozen=True)
class Nearest:
    """The most similar labelled line's status (``none``: a benign one), the similarity, and
    (from :meth:`NearestLines.name`) the line of the text that was near it."""

    status: ErrorStatus
    similarity: float
    line: str = ""
    shared: int = 0
    """Distinct words (not numbers) the line shares with the labelled one."""


class NearestLines:
    """Labelled lines in an inverted index of tf-idf weights (unit vectors), so a query
    costs the postings of its own tokens, not a pass over every line."""

    def __init__(self, docs: Sequence[Sequence[str]], labels: Sequence[str]) -> None:
        """``docs``: each line's :func:`tokens`; ``labels``: its status value (``none``:
        benign). An unknown status is an :class:`InvalidArgument`."""
        if len(docs) != len(labels):
            raise InvalidArgument(f"{len(docs)} lines but {len(labels)} labels")
        try:
            self.labels = tuple(ErrorStatus(label) for label in labels)
        except ValueError as e:
            raise InvalidArgument(f"nearest lines: {e}") from e
        df = Counter(w for d in docs for w in set(d))
        self.idf = {w: math.log(len(docs) / n) + 1.0 for w, n in df.items()}
        self._unknown_idf = math.log(max(len(docs), 1)) + 1.0  # a word no line has: the rarest
        self._words = [_plain(d) for d in docs]
        postings: defaultdict[str, list[tuple[int, float]]] = defaultdict(list)
        for i, doc in enumerate(docs):
            for w, x in self._vector(doc).items():
                postings[w].append((i, x))
        self._postings = dict(postings)

    def __len__(self) -> int:
        return len(self.labels)

    def _vector(self, doc: Iterable[str], *, query: bool = False) -> dict[str, float]:
        """Unit tf-idf vector of ``doc`` over the known words. A ``query``'s unknown words
        count in its norm (at the rarest word's idf), so a line is not judged on the few words
        it shares with the lines: a true cosine."""
        tf = Counter(doc)
        vec = {w: n * self.idf[w] for w, n in tf.items() if w in self.idf}
        unknown = (
            sum((n * self._unknown_idf) ** 2 for w, n in tf.items() if w not in self.idf) if query else 0.0
        )
        norm = math.sqrt(sum(x * x for x in vec.values()) + unknown) or 1.0
        return {w: x / norm for w, x in vec.items()}

    def nearest(self, doc: Sequence[str]) -> Nearest:
        """The line most similar to ``doc`` (its :func:`tokens`); ties to a benign line, then
        to the first listed. No known token: ``none`` at 0."""
        scores: defaultdict[int, float] = defaultdict(float)
        for w, x in self._vector(doc, query=True).items():
            for i, y in self._postings[w]:
                scores[i] += x * y
        if not scores:
            return Nearest(ErrorStatus.NONE, 0.0)
        best = min(scores, key=lambda i: (-scores[i], self.labels[i] is not ErrorStatus.NONE, i))
        return Nearest(self.labels[best], scores[best], shared=len(_plain(doc) & self._words[best]))

    def name(self, text: str, threshold: float = THRESHOLD) -> Nearest | None:
        """The failure status of the line of ``text`` nearest a labelled error line, at
        least ``threshold`` similar and sharing :data:`MIN_SHARED_WORDS` with it (the most
        similar wins, then the later line); None when every line is nearest a benign one or
        none is near enough."""
        best: tuple[float, int, Nearest] | None = None
        for position, line in enumerate(text.splitlines()):
            found = self.nearest(tokens(words(line)))
            if found.status is ErrorStatus.NONE or found.similarity < threshold:
                continue
            if found.shared < MIN_SHARED_WORDS:
                continue
            if best is None or (found.similarity, position) >= best[:2]:
                best = (found.similarity, position, replace(found, line=line))
        return None if best is None else best[2]


def _plain(doc: Iterable[str]) -> frozenset[str]:
    """The distinct words of a token list: no bigrams, no numbers."""
    return frozenset(w for w in doc if " " not in w and not w.isdigit())


def dump(lines: Iterable[tuple[str, str]], sets: Sequence[str]) -> str:
    """The data file's text for ``(status, text)`` lines from the corpus ``sets``: each
    line's :func:`words` (never its text), in order, one per line. Deterministic."""
    rows = [[status, " ".join(words(text))] for status, text in lines]
    unknown = sorted({status for status, _ in rows} - {s.value for s in ErrorStatus})
    if unknown:  # here, not when unicornd reads the file
        raise InvalidArgument(f"nearest lines: unknown statuses {unknown}")
    head = json.dumps({"version": DATA_VERSION, "sets": list(sets)})[:-1]
    body = ",\n".join(json.dumps(row, ensure_ascii=False) for row in rows)
    return f'{head}, "lines": [\n{body}\n]}}\n'  # one line per labelled line: a diff shows what changed


def parse(text: str) -> NearestLines:
    """:class:`NearestLines` from :func:`dump`'s text; malformed text is an
    :class:`InvalidArgument`."""
    try:
        doc = json.loads(text)
        if doc["version"] != DATA_VERSION:
            raise InvalidArgument(f"nearest lines: version {doc['version']}, expected {DATA_VERSION}")
        rows = [(str(status), str(ws).split()) for status, ws in doc["lines"]]
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgument(f"nearest lines: malformed data: {e}") from e
    return NearestLines([tokens(ws) for _, ws in rows], [status for status, _ in rows])


@cache
def builtin() -> NearestLines:
    """The packaged lines (``detect/nearest_lines.json``), read once per process."""
    return parse(resources.files("detect").joinpath("nearest_lines.json").read_text(encoding="utf-8"))
