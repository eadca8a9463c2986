"""Structured logging for every unicorn process (structlog).

Nothing here runs at import. An entry point's ``main()`` calls ``configure_logging``
once it has read its config (``configure_logging(cfg.log.level, cfg.log.format)``);
everything else only calls ``get_logger``. Daemons write JSON lines (``timestamp`` in
ISO 8601 UTC, ``level``, ``event``, ``logger`` and the bound keys); the CLI writes
readable lines. Records from the standard ``logging`` module (redis, asyncssh, ...) go
through the same renderer, so one process writes one format to one stream.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO, cast

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor

from unicorn_core.errors import ConfigError

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
FORMATS = ("auto", "json", "console")


class _NamedPrintLogger(structlog.PrintLogger):
    """A ``PrintLogger`` that knows its name, for ``structlog.stdlib.add_logger_name``."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class _NamedPrintLoggerFactory:
    """Makes the logger behind ``get_logger(name)``: ``name`` arrives as the first argument."""

    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> _NamedPrintLogger:
        return _NamedPrintLogger(self._file, str(args[0]) if args else "")


class _UnicornHandler(logging.StreamHandler[TextIO]):
    """The one root handler ``configure_logging`` installs (found again by its type)."""


def configure_logging(level: str, fmt: str, *, stream: TextIO | None = None) -> None:
    """Send all logging to ``stream`` (default: ``sys.stderr``) at ``level`` and above.

    ``fmt``: ``json`` (one JSON object per line), ``console`` (readable, coloured on a
    terminal), or ``auto`` (json unless ``stream`` is a terminal). Safe to call again: the
    new settings replace the old ones, including for loggers obtained before.
    """
    if level not in LEVELS:
        raise ConfigError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ConfigError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    out = sys.stderr if stream is None else stream
    terminal = _isatty(out)
    use_json = fmt == "json" or (fmt == "auto" and not terminal)

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Processor
    if use_json:
        # Tracebacks as data, without frame locals (they may hold secrets and are large).
        no_locals = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        shared.append(structlog.processors.ExceptionRenderer(no_locals))
        shared.append(_leading_keys_first)
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=terminal)

    structlog.configure(
        processors=[structlog.stdlib.add_logger_name, *shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        context_class=dict,
        logger_factory=_NamedPrintLoggerFactory(out),
        # Not cached, so loggers obtained before a (re)configuration follow the latest one.
        cache_logger_on_first_use=False,
    )

    handler = _UnicornHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    _remove_handlers(root)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])


def reset_logging() -> None:
    """Undo ``configure_logging`` (structlog defaults, our root handler removed). For tests."""
    structlog.reset_defaults()
    root = logging.getLogger()
    _remove_handlers(root)
    root.setLevel(logging.WARNING)


def get_logger(name: str, **bound: Any) -> FilteringBoundLogger:
    """A logger named ``name`` (the ``logger`` key) with ``bound`` keys on every event.

    Bind what the messages concern (``job_id=``, ``node=``); ``.bind(...)`` adds more.
    """
    # A lazy proxy: it follows the configuration in force when it logs, not when made.
    return cast(FilteringBoundLogger, structlog.get_logger(name, **bound))


_LEADING_KEYS = ("timestamp", "level", "logger", "event")


def _leading_keys_first(_logger: Any, _method: str, event_dict: EventDict) -> EventDict:
    """Put timestamp, level, logger and event first in each JSON line, for people reading."""
    leading = {key: event_dict.pop(key) for key in _LEADING_KEYS if key in event_dict}
    return {**leading, **event_dict}


def _remove_handlers(root: logging.Logger) -> None:
    for handler in [h for h in root.handlers if isinstance(h, _UnicornHandler)]:
        root.removeHandler(handler)
        handler.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
