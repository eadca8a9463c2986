"""``unicornctl classify`` through click's test runner (the command mounted on unicornctl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from unicornd.cli import cli

TAIL = (
    "iteration 10 | lm loss: 7.1\n"
    "NCCL WARN NET/IB : Got async event : port error\n"
    "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
)


@pytest.fixture(autouse=True)
def no_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("UNICORN_CONFIG", "UNICORN_DETECT__RULES_FILE"):
        monkeypatch.delenv(name, raising=False)


def run(*args: str, stdin: str = "") -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["classify", *args], input=stdin)
    return result.exit_code, result.output


def test_whole_text_json_from_stdin() -> None:
    code, out = run("--json", stdin=TAIL)
    assert code == 0
    doc = json.loads(out)
    assert (doc["status"], doc["severity"], doc["rule"]) == ("ecc_error", "SEV1", "ecc_uncorrectable")


def test_per_line_json_from_file(tmp_path: Path) -> None:
    path = tmp_path / "tail.log"
    path.write_text(TAIL)
    code, out = run(str(path), "--per-line", "--json")
    assert code == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert [(d["line"], d["status"], d["severity"]) for d in docs] == [
        (1, "none", None),
        (2, "link_flapping", "SEV3"),
        (3, "ecc_error", "SEV1"),
    ]


def test_text_output_and_benign() -> None:
    code, out = run(stdin="all fine\n")
    assert (code, out.strip()) == (0, "none")
    code, out = run("--per-line", stdin=TAIL)
    assert code == 0 and out.splitlines()[2].startswith("3: ecc_error SEV1 ecc_uncorrectable: RuntimeError")


def test_rules_option_and_configured_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "lint"\nstatus = "other_software_error"\npattern = "lm loss"\n')
    code, out = run("--rules", str(rules), "--per-line", "--json", stdin=TAIL)
    assert code == 0 and json.loads(out.splitlines()[0])["rule"] == "lint"
    monkeypatch.setenv("UNICORN_DETECT__RULES_FILE", str(rules))
    code, out = run("--per-line", "--json", stdin=TAIL)
    assert code == 0 and json.loads(out.splitlines()[0])["rule"] == "lint"


def test_bad_rules_file_exits_1_with_the_reason(tmp_path: Path) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "x"\nstatus = "melted"\npattern = "a"\n')
    code, out = run("--rules", str(rules), stdin=TAIL)
    assert code == 1 and "status 'melted' is not one of" in out and str(rules) in out
