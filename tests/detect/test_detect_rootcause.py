"""Root-cause choice across ranks: earliest primary evidence, severity within the tie window."""

from __future__ import annotations

import pytest

from detect.classify import BENIGN, Classifier, load_classifier
from detect.rootcause import Evidence, choose_root_cause
from unicorn_core.errors import InvalidArgument


@pytest.fixture(scope="module")
def c() -> Classifier:
    return load_classifier()


def test_dead_rank_beats_the_timeouts_and_resets_it_caused(c: Classifier) -> None:
    # the resets and timeouts on other ranks are seen *before* rank 3's exit is reported
    findings = [
        Evidence(
            "n1",
            0,
            100.0,
            c.classify_line("RuntimeError: [gloo/transport/tcp/pair.cc:598] Connection reset by peer"),
            "log",
        ),
        Evidence(
            "n2",
            5,
            100.2,
            c.classify_line("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)"),
            "log",
        ),
        Evidence("n1", 3, 101.5, c.classify_exit(None, 11), "exit"),
        Evidence("n2", 6, 102.0, c.classify_exit(1, None, "ncclRemoteError: A call failed"), "exit"),
    ]
    root = choose_root_cause(findings)
    assert root is not None and (root.node, root.rank, root.classification.rule) == (
        "n1",
        3,
        "crashed_sigsegv",
    )


def test_only_symptoms_then_the_earliest_symptom(c: Classifier) -> None:
    findings = [
        Evidence("n2", 1, 50.0, c.classify_line("Watchdog caught collective operation timeout"), "log"),
        Evidence(
            "n1",
            0,
            49.0,
            c.classify_line("socketProgressOpt: Call to recv failed : Connection reset by peer"),
        ),
    ]
    root = choose_root_cause(findings)
    assert root is not None and root.rank == 0


def test_simultaneous_findings_go_to_the_most_severe(c: Classifier) -> None:
    software = Evidence("n1", 0, 10.0, c.classify_exception("builtins.RuntimeError", "boom"), "exception")
    gpu = Evidence(
        "n2", 4, 10.4, c.classify_line("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus"), "log"
    )
    assert choose_root_cause([software, gpu]) is gpu
    assert choose_root_cause([software, gpu], simultaneous_s=0.1) is software  # outside the window: earliest
    later = Evidence("n2", 4, 12.0, gpu.classification)
    assert choose_root_cause([software, later]) is software


def test_ties_keep_input_order_and_benign_is_ignored(c: Classifier) -> None:
    a = Evidence("n1", 0, 5.0, c.classify_exit(1, None))
    b = Evidence("n2", 1, 5.0, c.classify_exit(1, None))
    assert choose_root_cause([a, b]) is a and choose_root_cause([b, a]) is b
    assert choose_root_cause([Evidence("n1", 0, 1.0, BENIGN)]) is None
    assert choose_root_cause([]) is None


def test_bad_input() -> None:
    with pytest.raises(InvalidArgument):
        Evidence("n1", 0, float("nan"), BENIGN)
    with pytest.raises(InvalidArgument):
        choose_root_cause([], simultaneous_s=-1.0)
