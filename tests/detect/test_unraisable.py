"""Python's reports of ignored exceptions are not evidence (detect.unraisable)."""

from __future__ import annotations

from detect.classify import load_classifier
from detect.statuses import ErrorStatus
from detect.unraisable import MAX_BLOCK_LINES, MAX_OPEN_BLOCKS, MAX_TRACEBACK_LINES, IgnoredBlocks, Tracebacks

# The shape CPython's default sys.unraisablehook prints (PyTorch's DataLoader at exit).
DATALOADER_AT_EXIT = [
    "Exception ignored in: <function _MultiProcessingDataLoaderIter.__del__ at 0x7f2b1c3a0ca0>",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3/dist-packages/torch/utils/data/dataloader.py", line 1478, in __del__',
    "    self._shutdown_workers()",
    "AttributeError: 'NoneType' object has no attribute 'python_exit_status'",
]


def _inside(lines: list[str]) -> list[bool]:
    blocks = IgnoredBlocks()
    return [blocks.inside(line) for line in lines]


def test_the_whole_report_is_inside_and_the_next_line_is_not() -> None:
    after = "ValueError: shapes (4, 16) and (8, 16) not aligned"
    assert _inside([*DATALOADER_AT_EXIT, after]) == [True] * 5 + [False]


def test_a_report_without_a_traceback_ends_at_its_exception_line() -> None:
    lines = ["Exception ignored in: <object repr() failed>", "RuntimeError: boom", "RuntimeError: real"]
    assert _inside(lines) == [True, True, False]


def test_only_lines_of_the_same_rank_prefix_continue_a_block() -> None:
    """Another rank's crash interleaved with rank 1's report is still evidence."""
    lines = [
        "[rank1]: Exception ignored in: <function NCCLCommunicator.__del__ at 0x7f00>",
        "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "comm.py", line 9, in __del__',
        "[rank1]: AttributeError: 'NCCLCommunicator' object has no attribute 'comm'",
        "[rank1]: AssertionError: a real one, after the report",
    ]
    assert _inside(lines) == [True, False, True, True, True, False]


def test_an_endless_block_is_given_up() -> None:
    lines = [DATALOADER_AT_EXIT[0], DATALOADER_AT_EXIT[1]] + ["    frame"] * (MAX_BLOCK_LINES + 5)
    flags = _inside(lines)
    assert all(flags[:MAX_BLOCK_LINES]) and not any(flags[MAX_BLOCK_LINES:])


def test_classify_text_skips_the_report_but_not_a_crash_after_it() -> None:
    classifier = load_classifier()
    assert classifier.classify_text("\n".join(DATALOADER_AT_EXIT)).status is ErrorStatus.NONE
    crash = "\n".join([*DATALOADER_AT_EXIT, "Segmentation fault (core dumped)"])
    assert classifier.classify_text(crash).status is ErrorStatus.EXITED_ABNORMALLY
    # the same exception line outside any report is the training code's error
    plain = "Traceback (most recent call last):\nAttributeError: 'Model' object has no attribute 'w'"
    assert classifier.classify_text(plain).status is ErrorStatus.OTHER_SOFTWARE_ERROR


def test_a_report_cut_short_hides_nothing_after_it() -> None:
    """Its rank was killed mid-report: the next line of that prefix is not an exception
    line, so it ends the block and is classified as usual (also in a later run)."""
    lines = [
        "[rank1]: Exception ignored in: <function Pool.__del__ at 0x7f00>",
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: node-2:17:17 [1] misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer",
        "[rank1]: RuntimeError: the next run's real error",
    ]
    assert _inside(lines) == [True, True, False, False]


def test_an_unprefixed_report_never_takes_a_rank_prefixed_line() -> None:
    lines = [
        "Exception ignored in: <function _ConnectionBase.__del__ at 0x7f00>",
        "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered",
        "(RayWorker pid=12) AssertionError: a worker's own failure",
        "Traceback (most recent call last):",
        "OSError: [Errno 9] Bad file descriptor",
    ]
    assert _inside(lines) == [True, False, False, True, True]


def test_the_oldest_open_block_makes_room_for_a_new_one() -> None:
    blocks = IgnoredBlocks()
    for i in range(MAX_OPEN_BLOCKS + 1):  # e.g. timestamped prefixes that never continue
        assert blocks.inside(f"{i:04d} Exception ignored in: <x>")
    assert blocks.inside(f"{MAX_OPEN_BLOCKS:04d} AttributeError: still followed")
    assert not blocks.inside("0000 AttributeError: the oldest was dropped")


def _closes(lines: list[str]) -> list[bool]:
    tracebacks = Tracebacks()
    return [tracebacks.closes(line) for line in lines]


def test_only_the_exception_line_that_ends_a_traceback_closes_it() -> None:
    """Python's traceback: the header, indented frames (source lines, caret markers), then
    the exception line. A chained exception's separator ends the first without closing it;
    the second header opens another."""
    lines = [
        "Traceback (most recent call last):",
        '  File "train.py", line 41, in step',
        "    loss = model(x)",
        "           ^^^^^^^^",
        "ValueError: shapes (4, 16) and (8, 16) not aligned",
        "ValueError: printed again by a handler",
        "",
        "Traceback (most recent call last):",
        '  File "train.py", line 9, in main',
        "Exception: base class",
    ]
    assert _closes(lines) == [False, False, False, False, True, False, False, False, False, True]


def test_an_exception_line_without_its_traceback_closes_nothing() -> None:
    """What a program printed: a handler logging str(e), a thread's shutdown message."""
    lines = ["RuntimeError: cannot join current thread", "iteration 5 | loss 2.1", "KeyError: 'x'"]
    assert _closes(lines) == [False, False, False]
    # a traceback cut off by another line of its prefix closes nothing either
    assert _closes(["Traceback (most recent call last):", "iteration 6", "KeyError: 'x'"]) == [False] * 3


def test_a_ranks_traceback_is_followed_by_its_prefix_among_other_ranks_lines() -> None:
    lines = [
        "[rank1]: Traceback (most recent call last):",
        "[rank0]: RuntimeError: rank 0 printed this itself",
        '[rank1]:   File "model.py", line 3, in forward',
        "[rank1]: AssertionError: bad shape",
        "AssertionError: unprefixed, after rank 1's traceback",
    ]
    assert _closes(lines) == [False, False, False, True, False]


def test_tracebacks_open_at_once_are_bounded() -> None:
    t = Tracebacks()
    for i in range(MAX_OPEN_BLOCKS + 10):
        t.closes(f"[rank{i}]: Traceback (most recent call last):")
    assert len(t._open) == MAX_OPEN_BLOCKS
    assert t.closes(f"[rank{MAX_OPEN_BLOCKS + 9}]: KeyError: 'x'")
    assert not t.closes("[rank0]: KeyError: 'x'")  # the oldest was dropped
    header = "Traceback (most recent call last):"
    endless = [header] + ["    frame"] * (MAX_TRACEBACK_LINES + 1) + ["KeyError: 'x'"]
    assert _closes(endless)[-1] is False


def test_a_deep_traceback_and_any_exception_name_close() -> None:
    """Review: 3.11 prints three lines a frame, so a 71-frame stack (a wrapped or compiled
    model) is 213 lines; and an exception's name need not end in Error ('ArrowInvalid')."""
    frames = ['  File "m.py", line 3, in f', "    return g()", "           ^^^"] * 71
    deep = ["[rank0]: Traceback (most recent call last):", *(f"[rank0]: {f}" for f in frames)]
    assert _closes([*deep, "[rank0]: ValueError: deep"])[-1] is True
    for last in ("pyarrow.lib.ArrowInvalid: JSON parse error", "KeyboardInterrupt"):
        assert _closes(["Traceback (most recent call last):", '  File "a.py", line 1', last])[-1] is True
