#!/usr/bin/env python3
"""Log-line classification throughput (the node agent scans every line of its ranks' output).

Classifies a mix of real lines (tests/detect/data/real-log-lines.toml, all faults) and
typical benign training output, with the literal prefilter (``detect.literals``) and
without it (every rule's regex on every line), in one run. Prints one JSON object:
lines per second for benign and fault lines, and the prefilter's speed-up ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from detect.classify import Classifier, load_classifier  # noqa: E402

BENIGN = [
    " iteration      100/  100000 | consumed samples:     3200 | elapsed time per iteration (ms): 812.3 | "
    "learning rate: 1.500E-04 | global batch size:    32 | lm loss: 7.121E+00 | loss scale: 1.0 | "
    "grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |",
    "node-1:100:200 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/IPC",
    "[rank0]: saving checkpoint at iteration     500 to /ckpt/iter_0000500",
    "Epoch 3:  41%|████      | 410/1000 [06:50<09:50,  1.00it/s, loss=2.31]",
    "  warnings.warn(",
]


def rate(classify: object, lines: list[str], seconds: float) -> float:
    """Lines per second of ``classify`` over ``lines`` repeated for about ``seconds``."""
    fn = classify  # a bound method
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for line in lines:
            fn(line)  # type: ignore[operator]
        done += len(lines)
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    args = parser.parse_args()
    data = tomllib.loads((REPO / "tests/detect/data/real-log-lines.toml").read_text(encoding="utf-8"))
    faults = [str(entry["text"]) for entry in data["line"]]
    classifier = load_classifier()
    unfiltered = Classifier(classifier.rules, prefilter=False)
    result = {
        "rules": len(classifier.rules),
        "benign_lines_per_s": round(rate(classifier.classify_line, BENIGN, args.seconds)),
        "fault_lines_per_s": round(rate(classifier.classify_line, faults, args.seconds)),
        "benign_lines_per_s_no_prefilter": round(rate(unfiltered.classify_line, BENIGN, args.seconds)),
        "fault_lines_per_s_no_prefilter": round(rate(unfiltered.classify_line, faults, args.seconds)),
    }
    result["prefilter_speedup_benign"] = round(
        result["benign_lines_per_s"] / result["benign_lines_per_s_no_prefilter"], 2
    )
    result["prefilter_speedup_fault"] = round(
        result["fault_lines_per_s"] / result["fault_lines_per_s_no_prefilter"], 2
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
