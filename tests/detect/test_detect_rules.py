"""The built-in rule table against real log lines, and rule files (schema, errors, precedence).

The real lines, with the issue thread each comes from, are in data/real-log-lines.toml.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detect.builtin_rules import BUILTIN_RULES
from detect.classify import Classifier, builtin_rules, load_classifier
from detect.literals import needles
from detect.rules import load_rules_file
from detect.statuses import DEFAULT_SEVERITY, ErrorStatus, Severity
from unicorn_core.errors import ConfigError

REAL_LINES: list[tuple[str, str, str]] = [
    (str(entry["text"]), str(entry["status"]), str(entry["rule"]))
    for entry in tomllib.loads((Path(__file__).parent / "data" / "real-log-lines.toml").read_text())["line"]
]

BENIGN_LINES = [
    " iteration      100/  100000 | consumed samples:     3200 | elapsed time per iteration (ms): 812.3 "
    "| learning rate: 1.500E-04 | global batch size:    32 | lm loss: 7.121E+00 | loss scale: 1.0 "
    "| grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |",
    # NVIDIA/nccl#1609
    "tj5-sc-ai-h800r-dev01:533:1765 [2] NCCL INFO 16 coll channels, 0 collnet channels, 16 nvls channels, "
    "16 p2p channels, 2 p2p channels per peer",
    "node-1:100:200 [0] NCCL INFO Call to connect returned Connection refused, retrying",
    "node-1:100:200 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/NVLink",
    # hpcaitech/ColossalAI#3514
    "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 812914 closing signal SIGTERM",
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
    "Traceback (most recent call last):",
    '  File "/home/u/train.py", line 55, in <module>',
    "saving checkpoint at iteration     500 to /ckpt",
    "UserWarning: TypedStorage is deprecated.",
    "error_file: <N/A>",
    "",
]


@pytest.fixture(scope="module")
def classifier() -> Classifier:
    return load_classifier()


@pytest.mark.parametrize(
    ("line", "status", "rule"), REAL_LINES, ids=[f"{r[2]}-{i}" for i, r in enumerate(REAL_LINES)]
)
def test_real_lines(classifier: Classifier, line: str, status: str, rule: str) -> None:
    result = classifier.classify_line(line)
    assert (result.status.value, result.rule) == (status, rule)
    assert result.severity is not None and result.evidence


@pytest.mark.parametrize("line", BENIGN_LINES)
def test_benign_lines(classifier: Classifier, line: str) -> None:
    result = classifier.classify_line(line)
    assert result.status is ErrorStatus.NONE and result.severity is None, result


def test_every_builtin_line_rule_has_a_real_line(classifier: Classifier) -> None:
    matched = {rule for _, _, rule in REAL_LINES}
    lines_rules = {r.name for r in builtin_rules() if r.pattern is not None and r.exception_type is None}
    benign = {"torchelastic_closing_signal", "cuda_async_hint", "nccl_info"}
    untested = lines_rules - matched - benign
    assert not untested, f"built-in line rules without a real line in this table: {sorted(untested)}"


def test_severity_defaults_follow_table1(classifier: Classifier) -> None:
    assert DEFAULT_SEVERITY[ErrorStatus.LOST_CONNECTION] is Severity.SEV1
    assert DEFAULT_SEVERITY[ErrorStatus.TASK_HANG] is Severity.SEV2
    assert DEFAULT_SEVERITY[ErrorStatus.LINK_FLAPPING] is Severity.SEV3
    assert set(DEFAULT_SEVERITY) == set(ErrorStatus) - {ErrorStatus.NONE}
    for rule in classifier.rules:
        if rule.status is not ErrorStatus.NONE and rule.name != "xid_94":
            assert rule.severity is DEFAULT_SEVERITY[rule.status], rule.name
    xid94 = next(r for r in classifier.rules if r.name == "xid_94")
    assert xid94.severity is Severity.SEV2  # contained: only the application restarts


def test_builtin_table_is_valid_and_named_uniquely() -> None:
    names = [str(table["name"]) for table in BUILTIN_RULES]
    assert len(names) == len(set(names))
    assert [r.name for r in builtin_rules()] == names


FILTERED = load_classifier()
UNFILTERED = Classifier(FILTERED.rules, prefilter=False)
_FRAGMENTS = (
    [line for line, _, _ in REAL_LINES] + BENIGN_LINES + ["NVLink", "nvlink ERROR", "KILL", "\uff23uda error"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), min_size=1, max_size=3), st.text(max_size=30), st.booleans())
def test_prefilter_never_changes_a_result(fragments: list[str], noise: str, upper: bool) -> None:
    line = noise.join(fragments)
    line = line.upper() if upper else line
    assert FILTERED.classify_line(line) == UNFILTERED.classify_line(line)


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"Connection reset by peer|ECONNRESET", ("connection reset by peer", "econnreset")),
        (r"Kill(?:ed)? process", (" process",)),
        (r"errors?", ("error",)),
        (r"ab\d{1,5}xyz", ("xyz",)),
        (r"a+bcd", ("bcd",)),
        (r"DMAR: \[DMA (?:Read|Write)", ("dmar: [dma ",)),
        (r"x|ab", None),  # an alternative without a 3-character literal
        (r"\x41BCD", None),  # an escape it does not model
        (r"[(|]abc", ("abc",)),  # brackets and bars inside a class are members, not syntax
    ],
)
def test_needles(pattern: str, expected: tuple[str, ...] | None) -> None:
    assert needles(re.compile(pattern)) == expected
    assert needles(re.compile(pattern, re.VERBOSE)) is None  # whitespace and comments: not modelled


# --------------------------------------------------------------------------- rule files


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rules.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_file_rules_come_first_and_replace_builtins_by_name(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[[rule]]
name = "fabric_manager"
status = "gpu_driver_error"
pattern = "fabric manager .* not running"
ignore_case = true

[[rule]]
name = "nccl_warn"        # replaces the built-in catch-all
status = "none"
pattern = "NCCL WARN"

[[rule]]
name = "xid_31_is_hardware_here"
status = "gpu_driver_error"
xid = [31]

[[rule]]
name = "exit_42"
status = "other_software_error"
exit_codes = [42]

[[rule]]
name = "my_error"
status = "other_network_error"
severity = "SEV2"
exception_type = "MyNetError"
message = "lost"

[[rule]]
name = "hot"
status = "gpu_driver_error"
gpu_kind = "temperature"
min_value = 90
""",
    )
    c = load_classifier(path)
    assert c.rules[0].name == "fabric_manager"
    assert c.classify_line("Fabric Manager is NOT running on this node").rule == "fabric_manager"
    ibv = "misc/ibvwrap.cc:288 NCCL WARN Call to ibv_reg_dmabuf_mr failed with error Operation not supported"
    assert c.classify_line(ibv).status is ErrorStatus.NONE
    assert sum(r.name == "nccl_warn" for r in c.rules) == 1
    assert c.classify_line("NVRM: Xid (PCI:0000:0a:00): 31, pid=1").rule == "xid_31_is_hardware_here"
    assert c.classify_exit(42, None).rule == "exit_42"
    exc = c.classify_exception("pkg.MyNetError", "peer lost")
    assert (exc.rule, exc.severity) == ("my_error", Severity.SEV2)
    assert c.classify_exception("pkg.MyNetError", "other").rule != "my_error"
    from unicorn_core.protocol import GpuFaultKind

    assert c.classify_gpu(GpuFaultKind.TEMPERATURE, 91).rule == "hot"
    assert c.classify_gpu(GpuFaultKind.TEMPERATURE, 85).rule == "gpu_overheat"  # built-in: any crossing


BAD_FILES = [
    ("[[rule]]\nname = 'x'\nstatus = 'ecc_error'\npattern = 'a'\ncolour = 'red'\n", "unknown key(s) colour"),
    ("[[rule]]\nname = 'x'\nstatus = 'melted'\npattern = 'a'\n", "status 'melted' is not one of"),
    ("[[rule]]\nname = 'x'\nstatus = 'ecc_error'\npattern = '('\n", "is not a valid regular expression"),
    ("[[rule]]\nname = 'x'\nstatus = 'ecc_error'\n", "needs exactly one matcher"),
    ("[[rule]]\nname = 'x'\nstatus = 'ecc_error'\npattern = 'a'\nxid = [1]\n", "needs exactly one matcher"),
    (
        "[[rule]]\nname = 'x'\nstatus = 'ecc_error'\nxid = [1]\nignore_case = true\n",
        "do not apply to a xid rule",
    ),
    (
        "[[rule]]\nname = 'x'\nstatus = 'none'\nseverity = 'SEV1'\npattern = 'a'\n",
        "status none has no severity",
    ),
    ("[[rule]]\nname = 'x'\nstatus = 'ecc_error'\nseverity = 'SEV9'\npattern = 'a'\n", "severity 'SEV9'"),
    ("[[rule]]\nname = 'x'\nstatus = 'ecc_error'\nsignals = ['SIGNOPE']\n", "'SIGNOPE' is not a signal"),
    ("[[rule]]\nname = 'x'\nstatus = 'ecc_error'\nexit_codes = [0]\n", "integers in 1..255"),
    ("[[rule]]\nname = 'x'\nstatus = 'ecc_error'\ngpu_kind = 'xid'\n", "classified by xid rules"),
    ("[[rule]]\nname = 'x'\nstatus = 'ecc_error'\npattern = ''\n", "must not be empty"),
    ("[[rule]]\nname = '9x'\nstatus = 'ecc_error'\npattern = 'a'\n", "must start with a letter"),
    (
        "[[rule]]\nname = 'x'\nstatus = 'ecc_error'\npattern = 'a'\n"
        "[[rule]]\nname = 'x'\nstatus = 'ecc_error'\npattern = 'b'\n",
        "used by an earlier rule",
    ),
    ("rules = []\n", "unknown key(s) rules"),
    ("[[rule]\n", "invalid TOML"),
]


@pytest.mark.parametrize(("text", "reason"), BAD_FILES)
def test_bad_rules_file_is_a_clear_config_error(tmp_path: Path, text: str, reason: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_classifier(path)
    message = str(info.value)
    assert str(path) in message and reason in message, message
    if "rule #" in message or "[[rule]]" not in text:
        return
    assert "rule #" in message


def test_bad_file_names_every_bad_rule_and_changes_nothing(tmp_path: Path) -> None:
    before = load_classifier()
    path = write(
        tmp_path,
        "[[rule]]\nname = 'good'\nstatus = 'ecc_error'\npattern = 'zap'\n"
        "[[rule]]\nname = 'bad1'\nstatus = 'nope'\npattern = 'a'\n"
        "[[rule]]\nname = 'bad2'\nstatus = 'ecc_error'\npattern = '['\n",
    )
    with pytest.raises(ConfigError, match=r"2 problems: rule #2 'bad1': .*; rule #3 'bad2': "):
        load_classifier(path)
    after = load_classifier()
    assert [r.name for r in after.rules] == [r.name for r in before.rules]
    assert after.classify_line("zap").status is ErrorStatus.NONE


def test_missing_rules_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_rules_file(tmp_path / "absent.toml")


def test_empty_rules_file_is_fine(tmp_path: Path) -> None:
    assert load_rules_file(write(tmp_path, "# nothing yet\n")) == ()
    assert len(load_classifier(write(tmp_path, "")).rules) == len(builtin_rules())
