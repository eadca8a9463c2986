#!/usr/bin/env python3
"""Log-line classification: accuracy on the real-line corpus, and throughput.

Accuracy. ``tests/detect/data/corpus/`` holds real lines with public sources, split once
by hash into train and held-out halves: ``errors-{train,heldout}.toml`` (evidence of a
failure, labelled with status and severity) and ``benign-{train,heldout}.toml`` (status
none). Rules may be written from the train halves only; the held-out halves are read here
and nowhere else, and only aggregate figures about them are printed:

- ``*_status_acc`` / ``*_severity_acc``: share of the split's *error* lines whose
  classified status (severity) equals the label (``train_n`` / ``held_out_n`` lines);
- ``held_out_status_acc_by_status``: the same per labelled status, ``[correct, n]``;
- ``held_out_vetoed``: held-out error lines that a benign rule (status none: a log level,
  a zero count, a retry, ...) classified as not evidence, i.e. misses by design of the
  precision rules rather than for want of a rule;
- ``benign_fires``: lines of both benign halves classified SEV1 or SEV2 (a healthy job
  would be restarted or its node drained); ``benign_fires_sev3``: those classified SEV3;
  ``benign_n``: benign lines.

``--show-misses train`` also lists every train line (errors and benign) classified other
than labelled, on stderr; held-out misses are never shown.

Throughput (``--speed SECONDS``): lines per second for real fault lines
(tests/detect/data/real-log-lines.toml) and typical benign training output, with the
literal prefilter (``detect.literals``) and without it (every rule's regex on every line).

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from detect.classify import Classification, Classifier, load_classifier  # noqa: E402
from detect.statuses import Severity  # noqa: E402

CORPUS = REPO / "tests/detect/data/corpus"
BENIGN = [
    " iteration      100/  100000 | consumed samples:     3200 | elapsed time per iteration (ms): 812.3 | "
    "learning rate: 1.500E-04 | global batch size:    32 | lm loss: 7.121E+00 | loss scale: 1.0 | "
    "grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |",
    "node-1:100:200 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/IPC",
    "[rank0]: saving checkpoint at iteration     500 to /ckpt/iter_0000500",
    "Epoch 3:  41%|████      | 410/1000 [06:50<09:50,  1.00it/s, loss=2.31]",
    "  warnings.warn(",
]


@dataclass(frozen=True)
class Line:
    """One labelled corpus line (``severity`` None for benign lines)."""

    text: str
    status: str
    severity: str | None
    source: str


def load(name: str) -> list[Line]:
    """The ``[[line]]`` tables of ``CORPUS/name.toml``; [] when the file is absent."""
    path = CORPUS / f"{name}.toml"
    if not path.exists():
        return []
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return [
        Line(
            str(e["text"]),
            str(e["status"]),
            str(e["severity"]) if "severity" in e else None,
            str(e["source"]),
        )
        for e in data.get("line", [])
    ]


def severity_of(result: Classification) -> str | None:
    return result.severity.value if result.severity is not None else None


def status_ok(result: Classification, line: Line) -> bool:
    return result.status.value == line.status


def severity_ok(result: Classification, line: Line) -> bool:
    return severity_of(result) == line.severity


def share(hits: int, n: int) -> float | None:
    return round(hits / n, 4) if n else None


def accuracy(classifier: Classifier, lines: list[Line]) -> tuple[float | None, float | None]:
    """(status accuracy, severity accuracy) of ``lines``; None for no lines."""
    results = [(classifier.classify_line(line.text), line) for line in lines]
    return (
        share(sum(status_ok(r, line) for r, line in results), len(lines)),
        share(sum(severity_ok(r, line) for r, line in results), len(lines)),
    )


def by_status(classifier: Classifier, lines: list[Line]) -> dict[str, list[int]]:
    """``{status: [correct, n]}`` of ``lines`` (status accuracy per labelled status)."""
    table: dict[str, list[int]] = {}
    for line in lines:
        entry = table.setdefault(line.status, [0, 0])
        entry[0] += status_ok(classifier.classify_line(line.text), line)
        entry[1] += 1
    return dict(sorted(table.items()))


def vetoed(classifier: Classifier, lines: list[Line]) -> int:
    """Error lines that a rule with status none (not the absence of a rule) made benign."""
    return sum(
        1
        for line in lines
        if (result := classifier.classify_line(line.text)).rule and result.severity is None
    )


def fires(classifier: Classifier, lines: Iterable[Line], severities: set[Severity]) -> int:
    return sum(classifier.classify_line(line.text).severity in severities for line in lines)


def misses(classifier: Classifier, lines: list[Line]) -> list[tuple[Line, Classification]]:
    """Lines whose status or severity differs from the label."""
    found = []
    for line in lines:
        result = classifier.classify_line(line.text)
        if not (status_ok(result, line) and severity_ok(result, line)):
            found.append((line, result))
    return found


def measure(classifier: Classifier) -> dict[str, object]:
    """The accuracy figures (see module doc)."""
    train, held_out = load("errors-train"), load("errors-heldout")
    benign = load("benign-train") + load("benign-heldout")
    train_status, train_severity = accuracy(classifier, train)
    held_status, held_severity = accuracy(classifier, held_out)
    return {
        "train_status_acc": train_status,
        "train_severity_acc": train_severity,
        "train_n": len(train),
        "held_out_status_acc": held_status,
        "held_out_severity_acc": held_severity,
        "held_out_n": len(held_out),
        "held_out_status_acc_by_status": by_status(classifier, held_out),
        "held_out_vetoed": vetoed(classifier, held_out),
        "benign_fires": fires(classifier, benign, {Severity.SEV1, Severity.SEV2}),
        "benign_fires_sev3": fires(classifier, benign, {Severity.SEV3}),
        "benign_n": len(benign),
    }


def rate(classify: Callable[[str], object], lines: list[str], seconds: float) -> float:
    """Lines per second of ``classify`` over ``lines`` repeated for about ``seconds``."""
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for line in lines:
            classify(line)
        done += len(lines)
    return done / (time.perf_counter() - start)


def speed(classifier: Classifier, seconds: float) -> dict[str, object]:
    """Throughput figures (see module doc)."""
    data = tomllib.loads((REPO / "tests/detect/data/real-log-lines.toml").read_text(encoding="utf-8"))
    faults = [str(entry["text"]) for entry in data["line"]]
    unfiltered = Classifier(classifier.rules, prefilter=False)
    result: dict[str, object] = {
        "rules": len(classifier.rules),
        "benign_lines_per_s": round(rate(classifier.classify_line, BENIGN, seconds)),
        "fault_lines_per_s": round(rate(classifier.classify_line, faults, seconds)),
        "benign_lines_per_s_no_prefilter": round(rate(unfiltered.classify_line, BENIGN, seconds)),
        "fault_lines_per_s_no_prefilter": round(rate(unfiltered.classify_line, faults, seconds)),
    }
    for kind in ("benign", "fault"):
        filtered, plain = result[f"{kind}_lines_per_s"], result[f"{kind}_lines_per_s_no_prefilter"]
        assert isinstance(filtered, int) and isinstance(plain, int)
        result[f"prefilter_speedup_{kind}"] = round(filtered / plain, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--show-misses",
        choices=["train"],
        help="list the train lines classified other than labelled (on stderr)",
    )
    parser.add_argument("--speed", type=float, metavar="SECONDS", help="also measure throughput, per case")
    args = parser.parse_args()
    classifier = load_classifier()
    result = measure(classifier)
    if args.speed:
        result.update(speed(classifier, args.speed))
    if args.show_misses == "train":
        for line, got in misses(classifier, load("errors-train") + load("benign-train")):
            print(
                f"MISS want {line.status}/{line.severity} got {got.status}/{severity_of(got)} "
                f"({got.rule or '-'}) [{line.source}]\n  {line.text}",
                file=sys.stderr,
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
