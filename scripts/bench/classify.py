#!/usr/bin/env python3
"""Log-line classification: accuracy on the real-line corpus, and throughput.

Accuracy. ``tests/detect/data/corpus/`` holds real lines with public sources:
``errors-*.toml`` (evidence of a failure, labelled with status and severity) and
``benign-*.toml`` (status none), in three sets:

- ``train`` (``*-train.toml``): the rules are written from these;
- ``dev`` (``*-heldout.toml``): the first held-out half, split from train by hash before
  any rule was written. Its aggregate score was looked at while rules were added, and its
  misses were read to write rules on 2026-11-25, so it is no longer blind: reported as
  ``dev_*``;
- ``fresh`` (``fresh/*-errors.toml``, ``fresh/*-benign.toml``): the blind set of
  2026-11-25, lines from sources in neither of the others, collected by collectors who
  never saw the rules. It was measured blind three times (BENCHMARKS.md); once a newer
  blind set existed (2026-11-29) its misses were read to write rules, so it is reported as
  ``fresh_*``;
- ``blind2``, ``blind3``, ... (``blindN/*-errors.toml``, ``blindN/*-benign.toml``): the
  later blind sets (``sets.toml`` there lists every set held out whole, in the order they were
  collected). Each was measured blind once (BENCHMARKS.md); once a newer blind set existed its
  misses were read to write rules, so it is reported as ``blindN_*`` (the corpus README says
  when each was collected and spent);
- ``held_out`` (the last set ``sets.toml`` lists): the newest
  blind set, from sources in none of the sets above, collected by four collectors who
  never saw the rules. Its lines are read here and nowhere else; only aggregate figures
  about them are printed.

Figures:

- ``*_status_acc`` / ``*_severity_acc``: share of the set's *error* lines whose
  classified status (severity) equals the label (``*_n`` lines);
- ``held_out_status_acc_by_status``: the same per labelled status, ``[correct, n]``;
- ``held_out_vetoed``: held-out error lines that a benign rule (status none: a log level,
  a zero count, a retry, ...) classified as not evidence, i.e. misses by design of the
  precision rules rather than for want of a rule;
- ``benign_fires``: benign lines of all the sets classified SEV1 or SEV2 (a healthy job
  would be restarted or its node drained); ``benign_fires_sev3``: those classified SEV3;
  ``benign_n``: benign lines; ``<set>_benign_fires``/``<set>_benign_n``: the same for
  one set.
- ``benign_fires_agent`` and ``<set>_benign_fires_agent``: the same benign lines, each set
  in file order, through a real node agent's output path (:meth:`launcher.agent.Agent._on_line`,
  no rank having exited): what the agent would send at SEV1 or SEV2. The agent never sends a
  copy of a kernel or node-tool report, a line inside Python's report of an ignored
  exception, an exit line long after any exit, or a generic exception line that ends no
  traceback, at those severities. Its de-duplication of repeated reports is cleared before
  each line, so each line counts.

- ``held_out_exit_*``: each blind error line as the whole output of a rank that exited
  with code 1 (:meth:`Classifier.classify_exit`: a rule's status, else the nearest labelled
  line's, :mod:`detect.nearest` (``[detect] nearest_lines``, off by default), else
  ``exited_abnormally``; so lines labelled
  ``exited_abnormally`` are right without any rule): ``held_out_exit_status_acc_rules``
  without the nearest lines, ``held_out_exit_status_acc`` with them (one run),
  ``held_out_exit_named``/``_named_right``: exits they named (rightly); and
  ``held_out_exit_benign_named``: blind benign lines they named a cause of such an exit
  (a wrong cause when a rank's last line was benign). Only the blind set: every other set
  is in the labelled lines, where each line is its own nearest.

``--show-misses train|dev|<a spent set>`` also lists every line of that
set (errors and benign) classified other than labelled, on stderr; held-out misses are never
shown. The agent's own log lines go to stderr (warnings only).

Throughput (``--speed SECONDS``): lines per second for real fault lines
(tests/detect/data/real-log-lines.toml) and typical benign training output, with the
literal prefilter (``detect.literals``) and without it (every rule's regex on every line).

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from detect.classify import NEAREST_RULE, Classification, Classifier, load_classifier  # noqa: E402
from detect.nearest import builtin as builtin_nearest  # noqa: E402
from detect.statuses import Severity  # noqa: E402
from launcher.agent import Agent  # noqa: E402
from unicorn_core.config import Config  # noqa: E402
from unicorn_core.logs import configure_logging  # noqa: E402
from unicorn_core.protocol import FaultReport, Message  # noqa: E402

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
    """The ``[[line]]`` tables of ``CORPUS/name.toml`` (a glob pattern is allowed, e.g.
    ``fresh/*-errors``); [] when no file matches."""
    lines = []
    for path in sorted(CORPUS.glob(f"{name}.toml")):
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        lines += [
            Line(
                str(e["text"]),
                str(e["status"]),
                str(e["severity"]) if "severity" in e else None,
                str(e["source"]),
            )
            for e in data.get("line", [])
        ]
    return lines


HELD_OUT_SETS: Final[tuple[str, ...]] = tuple(tomllib.loads((CORPUS / "sets.toml").read_text())["held_out"])
"""The sets held out whole, in the order they were collected: the last is the blind set
(``held_out`` below), the others are spent."""
SPENT: Final = HELD_OUT_SETS[:-1]
BLIND: Final = HELD_OUT_SETS[-1]
SETS: Final = {
    "train": ("errors-train", "benign-train"),
    "dev": ("errors-heldout", "benign-heldout"),
    **{name: (f"{name}/*-errors", f"{name}/*-benign") for name in SPENT},
    "held_out": (f"{BLIND}/*-errors", f"{BLIND}/*-benign"),
}
"""Set name -> (error lines, benign lines), see the module doc."""


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


def agent_fires(lines: list[Line]) -> int:
    """Lines a real node agent sends at SEV1/SEV2 when the ranks print them in this order
    (see the module doc)."""
    with tempfile.TemporaryDirectory(prefix="unicorn-classify-") as tmp:
        agent = Agent(Config(), job_id=1, node="n1", run_dir=Path(tmp), argv=[])
        sent: list[Message] = []
        agent._emit = sent.append  # type: ignore[method-assign,assignment]
        fired = 0
        for line in lines:
            agent._recent_faults.clear()
            before = len(sent)
            agent._on_line(line.text.replace("\n", " "))
            fired += any(isinstance(m, FaultReport) and m.severity in ("SEV1", "SEV2") for m in sent[before:])
        return fired


def exits(classifier: Classifier, errors: list[Line], benign: list[Line]) -> dict[str, object]:
    """The blind set's lines each as the whole output of a rank that exited 1 (see the
    module doc): status accuracy with the rules alone and with the nearest labelled lines,
    the exits the nearest lines named (right), and benign lines they named a cause."""
    alone, nearest = Classifier(classifier.rules), Classifier(classifier.rules, nearest=builtin_nearest())
    got = [(nearest.classify_exit(1, None, line.text), line) for line in errors]
    named = [(c, line) for c, line in got if c.rule == NEAREST_RULE]
    return {
        "held_out_exit_status_acc_rules": share(
            sum(status_ok(alone.classify_exit(1, None, line.text), line) for line in errors), len(errors)
        ),
        "held_out_exit_status_acc": share(sum(status_ok(c, line) for c, line in got), len(errors)),
        "held_out_exit_named": len(named),
        "held_out_exit_named_right": sum(status_ok(c, line) for c, line in named),
        "held_out_exit_benign_named": sum(
            nearest.classify_exit(1, None, line.text).rule == NEAREST_RULE for line in benign
        ),
    }


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
    result: dict[str, object] = {}
    benign: list[Line] = []
    serious = {Severity.SEV1, Severity.SEV2}
    for name, (errors_file, benign_file) in SETS.items():
        errors, quiet = load(errors_file), load(benign_file)
        status, severity = accuracy(classifier, errors)
        result |= {f"{name}_status_acc": status, f"{name}_severity_acc": severity, f"{name}_n": len(errors)}
        result |= {f"{name}_benign_fires": fires(classifier, quiet, serious), f"{name}_benign_n": len(quiet)}
        result[f"{name}_benign_fires_agent"] = agent_fires(quiet)
        benign += quiet
    held_out = load(SETS["held_out"][0])
    return (
        result
        | exits(classifier, held_out, load(SETS["held_out"][1]))
        | {
            "held_out_status_acc_by_status": by_status(classifier, held_out),
            "held_out_vetoed": vetoed(classifier, held_out),
            "benign_fires": fires(classifier, benign, serious),
            "benign_fires_sev3": fires(classifier, benign, {Severity.SEV3}),
            "benign_fires_agent": sum(
                v for k, v in result.items() if k.endswith("_benign_fires_agent") and isinstance(v, int)
            ),
            "benign_n": len(benign),
        }
    )


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
        choices=[name for name in SETS if name != "held_out"],
        help="list the lines of that set classified other than labelled (on stderr)",
    )
    parser.add_argument("--speed", type=float, metavar="SECONDS", help="also measure throughput, per case")
    args = parser.parse_args()
    configure_logging("warning", "console", stream=sys.stderr)  # stdout: one JSON object
    classifier = load_classifier()
    result = measure(classifier)
    if args.speed:
        result.update(speed(classifier, args.speed))
    if args.show_misses:
        errors_file, benign_file = SETS[args.show_misses]
        for line, got in misses(classifier, load(errors_file) + load(benign_file)):
            print(
                f"MISS want {line.status}/{line.severity} got {got.status}/{severity_of(got)} "
                f"({got.rule or '-'}) [{line.source}]\n  {line.text}",
                file=sys.stderr,
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
