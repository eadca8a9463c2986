"""unicorn_core.logs: JSON and console output, levels, idempotent configuration."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from unicorn_core.errors import ConfigError
from unicorn_core.logs import configure_logging, get_logger, reset_logging


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    reset_logging()


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_carry_bound_keys() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log = get_logger("unicornd.reconcile", job_id=42)
    log.info("job requeued", node="gpu-3")
    log.bind(attempt=2).warning("retrying")

    first, second = json_lines(out)
    assert first["event"] == "job requeued"
    assert first["level"] == "info"
    assert first["logger"] == "unicornd.reconcile"
    assert first["job_id"] == 42
    assert first["node"] == "gpu-3"
    assert (second["level"], second["attempt"], second["job_id"]) == ("warning", 2, 42)
    stamp = datetime.fromisoformat(first["timestamp"])
    assert stamp.utcoffset() is not None
    assert stamp.utcoffset().total_seconds() == 0  # type: ignore[union-attr]
    assert list(first)[:4] == ["timestamp", "level", "logger", "event"]


def test_level_filtering() -> None:
    out = io.StringIO()
    configure_logging("warning", "json", stream=out)
    log = get_logger("test")
    log.debug("hidden")
    log.info("hidden too")
    log.warning("shown")
    log.error("shown too")
    assert [line["event"] for line in json_lines(out)] == ["shown", "shown too"]


def test_stdlib_logging_uses_the_same_format_and_level() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    logging.getLogger("redis.connection").debug("hidden")
    logging.getLogger("redis.connection").warning("reconnecting to %s", "db")
    (line,) = json_lines(out)
    assert line["logger"] == "redis.connection"
    assert (line["event"], line["level"]) == ("reconnecting to db", "warning")


def test_exceptions_are_structured_without_locals() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    secret = "hunter2"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger("test").exception("failed")
    (line,) = json_lines(out)
    assert line["exception"][0]["exc_type"] == "RuntimeError"
    assert secret not in out.getvalue()


def test_configure_twice_replaces_the_first() -> None:
    first, second = io.StringIO(), io.StringIO()
    log = get_logger("test")  # obtained before configuration: follows the latest one
    configure_logging("info", "json", stream=first)
    configure_logging("debug", "json", stream=second)
    log.debug("once")
    logging.getLogger("lib").info("stdlib once")
    assert first.getvalue() == ""
    assert [line["event"] for line in json_lines(second)] == ["once", "stdlib once"]


def test_console_format_is_readable() -> None:
    out = io.StringIO()
    configure_logging("info", "console", stream=out)
    get_logger("unicornctl", job_id=7).info("submitted")
    text = out.getvalue()
    assert "submitted" in text
    assert "job_id=7" in text
    assert not text.startswith("{")
    assert "\x1b[" not in text  # no colour codes when the stream is not a terminal


def test_auto_is_json_when_not_a_terminal() -> None:
    out = io.StringIO()
    configure_logging("info", "auto", stream=out)
    get_logger("test").info("hello")
    assert json_lines(out)[0]["event"] == "hello"


def test_auto_is_console_on_a_terminal() -> None:
    out = FakeTerminal()
    configure_logging("info", "auto", stream=out)
    get_logger("test").info("hello")
    assert "hello" in out.getvalue()
    assert not out.getvalue().startswith("{")


@pytest.mark.parametrize(("level", "fmt"), [("loud", "json"), ("info", "xml")])
def test_bad_level_or_format(level: str, fmt: str) -> None:
    with pytest.raises(ConfigError):
        configure_logging(level, fmt, stream=io.StringIO())
