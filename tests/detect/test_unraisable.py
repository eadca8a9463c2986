"""Python's reports of ignored exceptions are not evidence (detect.unraisable)."""

from __future__ import annotations

from detect.classify import load_classifier
from detect.statuses import ErrorStatus
from detect.unraisable import MAX_BLOCK_LINES, IgnoredBlocks

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
