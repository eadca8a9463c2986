"""Failure detection and classification: pure functions of evidence and a clock.

- :mod:`detect.statuses`: Unicron's error statuses and severities (Table 1).
- :mod:`detect.rules`, :mod:`detect.builtin_rules`: classification rules as data.
- :mod:`detect.classify`: :func:`load_classifier` and :class:`Classifier`.
- :mod:`detect.rootcause`: :func:`choose_root_cause` across ranks and nodes.
- :mod:`detect.stats`: :class:`IterationMonitor` (hangs, slowdowns).
- :mod:`detect.stragglers`: :class:`~detect.stragglers.StragglerMonitor` (a node slower than
  its peers, from per-rank compute times).
- :mod:`detect.liveness`: :class:`HeartbeatTracker` (lost node agents).
- :mod:`detect.pairing`: the two-round paired node check.
"""

from detect.classify import BENIGN, Classification, Classifier, builtin_rules, load_classifier
from detect.liveness import Expired, HeartbeatTracker, Liveness
from detect.pairing import Diagnosis, GroupResult, RepairPlan, diagnose, pair_nodes, repair_suspects
from detect.rootcause import Evidence, choose_root_cause
from detect.rules import Rule, RuleKind, load_rules_file
from detect.stats import (
    SLOW_STEP_TIMEOUT_S,
    HangVerdict,
    IterationMonitor,
    IterationStats,
    StragglerReference,
)
from detect.statuses import DEFAULT_SEVERITY, ErrorStatus, Severity, default_severity, worst

__all__ = [
    "BENIGN",
    "DEFAULT_SEVERITY",
    "SLOW_STEP_TIMEOUT_S",
    "Classification",
    "Classifier",
    "Diagnosis",
    "ErrorStatus",
    "Evidence",
    "Expired",
    "GroupResult",
    "HangVerdict",
    "HeartbeatTracker",
    "IterationMonitor",
    "IterationStats",
    "Liveness",
    "RepairPlan",
    "Rule",
    "RuleKind",
    "Severity",
    "StragglerReference",
    "builtin_rules",
    "choose_root_cause",
    "default_severity",
    "diagnose",
    "load_classifier",
    "load_rules_file",
    "pair_nodes",
    "repair_suspects",
    "worst",
]
