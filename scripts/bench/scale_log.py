#!/usr/bin/env python3
"""What unicornd did in a scale run, from its log (``scale.py --keep-log DIR``).

Prints one JSON object: findings by rule; heartbeat findings the ladder ignored (their node
is not the task's); each plan's requeues and how long after the plan's commit its last
requeue and its last action were done (allocation changes run one at a time, so this is
the plan's queue); and every ``operator_needed`` with its reason.

Usage: ``scale_log.py DIR/unicornd-4096.log``
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

PLAN = re.compile(r"(plan-\d+)[:/]")


def _time(doc: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(doc["timestamp"]).replace("Z", "+00:00")).timestamp()


def _after(requeues: list[tuple[str, float]], plan: str, t0: float) -> float:
    return round(max((t for p, t in requeues if p == plan), default=t0) - t0, 1)


def summarise(path: Path) -> dict[str, Any]:
    rules: Counter[str] = Counter()
    ignored = 0
    committed: dict[str, float] = {}
    last: dict[str, float] = {}
    requeues: list[tuple[str, float]] = []
    operator: list[dict[str, str]] = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict) or "timestamp" not in doc:
            continue
        event, t = doc.get("event"), _time(doc)
        note, action = str(doc.get("note", "")), str(doc.get("action", ""))
        if event == "finding":
            rules[str(doc.get("rule"))] += 1
        elif event == "decision":
            m = PLAN.match(note)
            if m is not None:
                committed.setdefault(m.group(1), t)
            if note.startswith("finding heartbeat") and note.endswith("; ignored"):
                ignored += 1
        elif event == "action_done":
            m = PLAN.match(action)
            if m is not None:
                last[m.group(1)] = max(last.get(m.group(1), t), t)
                if doc.get("kind") == "requeue":
                    requeues.append((m.group(1), t))
        elif event == "operator_needed":
            operator.append({"incident": str(doc.get("incident")), "why": str(doc.get("why"))[:200]})
    plans = {
        plan: {
            "requeues": sum(1 for p, _ in requeues if p == plan),
            "last_requeue_s_after_commit": _after(requeues, plan, t0),
            "last_action_s_after_commit": round(last.get(plan, t0) - t0, 1),
        }
        for plan, t0 in committed.items()
    }
    return {
        "log": str(path),
        "findings_by_rule": dict(rules),
        "heartbeat_findings_ignored": ignored,
        "plans": plans,
        "operator_needed": operator,
    }


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: scale_log.py UNICORND_LOG")
    print(json.dumps(summarise(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
