#!/usr/bin/env python3
"""Could a model learned from the labelled lines replace or back the rules? Leave-one-set-out.

The rules (``detect/builtin_rules.py``) reach 0.63-0.78 status accuracy on each new blind set
(BENCHMARKS.md), against the issue's goal of 0.95. This bench asks whether a standard
text classifier trained on the same labelled lines does better on lines from sources it has
not seen, the question a learned fallback for lines no rule matches would have to answer.

Protocol: for each spent blind set (``fresh``, ``blind2`` ...; see ``classify.py``) in turn,
train on every other set the rules may be written from (train, dev and the other spent blind
sets, errors and benign lines alike, benign labelled ``none``) and classify the left-out set.
Each set's sources appear in no other set (``scripts/corpus-split`` checks), so this is the
same situation as the rules' one blind measurement of that set. The blind set (``held_out``)
is never read.

Models (standard baselines, no tuning on the left-out sets; settings fixed below):

- ``nb``: multinomial naive Bayes over word unigrams and bigrams (lower case; digit runs longer
  than 3 dropped: addresses, PIDs, timestamps), add-one smoothing;
- ``knn``: the label of the most similar training line (cosine over tf-idf of the same
  tokens), i.e. "this line resembles a known one".

Figures per left-out set and pooled over them: ``*_status_acc`` (error lines whose predicted
status equals the label), ``*_benign_fired`` (benign lines predicted as any failure status:
what a fallback would have reported).

``--fallback THRESHOLD``: also the blind set (``held_out``) through the rules with a fallback:
a line no rule matches (not even a benign one) gets the status of the nearest training line
(every set but the blind one) when their cosine similarity is at least THRESHOLD and they share
two words (:meth:`detect.nearest.NearestLines.name`, as the product names a bare exit's cause); aggregates
only (``fallback_*``): status accuracy of the rules alone and with the fallback, error lines
the fallback named right and wrong, benign lines it called a failure (a fallback would report
them at SEV3 at most). 0.3 was chosen on blind8 with the rules blind8 was measured with
(9c0e437): there it took 0.689 to 0.748 and called 1 of 181 benign lines a failure (0.0: 0.815
and 13; 0.5: 0.711 and 0).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))  # also when the tests load this file

from benchload import load_bench  # noqa: E402

from detect import nearest  # noqa: E402


def _corpus() -> ModuleType:
    return load_bench("classify")


def tokens(text: str) -> list[str]:
    """Unigrams and bigrams of ``text`` (see the module doc): :mod:`detect.nearest`'s."""
    return nearest.tokens(nearest.words(text))


class NaiveBayes:
    """Multinomial naive Bayes with add-one smoothing."""

    def __init__(self, docs: Sequence[list[str]], labels: Sequence[str]) -> None:
        self.classes = sorted(set(labels))
        self.vocab = {w for d in docs for w in d}
        self.prior = {c: math.log(labels.count(c) / len(labels)) for c in self.classes}
        self.counts: dict[str, Counter[str]] = {c: Counter() for c in self.classes}
        for doc, label in zip(docs, labels, strict=True):
            self.counts[label].update(doc)
        self.totals = {c: sum(self.counts[c].values()) for c in self.classes}

    def predict(self, doc: list[str]) -> str:
        v = len(self.vocab)
        known = [w for w in doc if w in self.vocab]

        def score(c: str) -> float:
            n = self.totals[c] + v
            return self.prior[c] + sum(math.log((self.counts[c][w] + 1) / n) for w in known)

        return max(self.classes, key=score)


class NearestLine:
    """The label of the training line with the highest tf-idf cosine similarity: the
    product's index (:class:`detect.nearest.NearestLines`), labels as strings."""

    def __init__(self, docs: Sequence[list[str]], labels: Sequence[str]) -> None:
        self.index = nearest.NearestLines(docs, labels)

    def predict(self, doc: list[str]) -> str:
        return self.nearest(doc)[0]

    def nearest(self, doc: list[str]) -> tuple[str, float]:
        """The nearest training line's label and its cosine similarity (``none``, 0: no known token)."""
        found = self.index.nearest(doc)
        return found.status.value, found.similarity


def fallback(bench: ModuleType, names: list[str], threshold: float) -> dict[str, Any]:
    """The blind set through the rules, then the nearest-line fallback (see the module doc)."""
    sets = [bench.load(bench.SETS[n][0]) + bench.load(bench.SETS[n][1]) for n in names]
    lines = [line for group in sets for line in group]
    model = NearestLine([tokens(line.text) for line in lines], [line.status for line in lines])
    classifier = bench.load_classifier()
    errors, benign = bench.load(bench.SETS["held_out"][0]), bench.load(bench.SETS["held_out"][1])

    def named(text: str) -> tuple[str, str | None]:
        """The rules' status, and the fallback's (None: a rule matched, or no line is near enough)."""
        result = classifier.classify_line(text)
        if result.rule:
            return result.status.value, None
        found = model.index.name(text, threshold)  # as the product names an exit's line
        return result.status.value, found.status.value if found is not None else None

    results = [(named(line.text), line.status) for line in errors]
    rules_right = sum(rules == want for (rules, _), want in results)
    right = sum(got == want for (_, got), want in results if got is not None)
    wrong = sum(got != want for (_, got), want in results if got is not None)
    fired = sum(named(line.text)[1] is not None for line in benign)
    return {
        "fallback_threshold": threshold,
        "fallback_rules_status_acc": round(rules_right / len(errors), 4),
        "fallback_status_acc": round((rules_right + right) / len(errors), 4),
        "fallback_named_right": right,
        "fallback_named_wrong": wrong,
        "fallback_benign_fired": fired,
        "fallback_n": len(errors),
        "fallback_benign_n": len(benign),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fallback", type=float, metavar="THRESHOLD", help="also the blind set (module doc)")
    args = parser.parse_args(argv)
    bench = _corpus()
    names = [n for n in bench.SETS if n != "held_out"]
    sets = {n: (bench.load(bench.SETS[n][0]), bench.load(bench.SETS[n][1])) for n in names}
    spent = [n for n in names if n not in ("train", "dev")]
    out: dict[str, Any] = {"models": ["nb", "knn"], "left_out": spent}
    pooled: Counter[str] = Counter()
    for left in spent:
        lines = [line for n in names if n != left for line in sets[n][0] + sets[n][1]]
        docs, labels = [tokens(line.text) for line in lines], [line.status for line in lines]
        models = {"nb": NaiveBayes(docs, labels), "knn": NearestLine(docs, labels)}
        errors, benign = sets[left]
        row: dict[str, Any] = {"n": len(errors), "benign_n": len(benign)}
        for key, model in models.items():
            right = sum(model.predict(tokens(line.text)) == line.status for line in errors)
            fired = sum(model.predict(tokens(line.text)) != "none" for line in benign)
            row[f"{key}_status_acc"] = round(right / len(errors), 4)
            row[f"{key}_benign_fired"] = fired
            pooled[f"{key}_right"] += right
            pooled[f"{key}_fired"] += fired
        pooled["n"] += len(errors)
        pooled["benign_n"] += len(benign)
        out[left] = row
    for key in ("nb", "knn"):
        out[f"{key}_status_acc"] = round(pooled[f"{key}_right"] / pooled["n"], 4)
        out[f"{key}_benign_fired"] = pooled[f"{key}_fired"]
    out["n"], out["benign_n"] = pooled["n"], pooled["benign_n"]
    if args.fallback is not None:
        out |= fallback(bench, names, args.fallback)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
