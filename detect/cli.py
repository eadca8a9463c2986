"""``unicornctl classify``: classify a log excerpt the way the node agent does.

``classify [FILE|-] [--per-line] [--json] [--rules FILE]`` reads FILE (default: stdin)
and prints the most severe classification of the whole text, or with ``--per-line`` one
result per line with its line number. Exit status 0 whenever the text was classified
(a fault found is a result, not an error); 1 for a bad rules file.

Rules: the built-ins, preceded by ``--rules FILE``, else by the configured
``detect.rules_file`` (from ``unicornctl --config``, ``$UNICORN_CONFIG`` or
``UNICORN_DETECT__RULES_FILE``), so the command agrees with the agents.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

import click

from detect.classify import Classification, Classifier, load_classifier
from unicorn_core.config import load_config
from unicorn_core.errors import ConfigError


def _configured_rules(ctx: click.Context) -> str:
    obj = ctx.find_root().obj
    path = obj.get("config_path") if isinstance(obj, dict) else None
    return load_config(path).detect.rules_file


def _text(result: Classification) -> str:
    if not result.is_fault:
        return "none"
    return f"{result.status} {result.severity} {result.rule}: {result.evidence}"


@click.command("classify")
@click.argument("source", type=click.File("r", encoding="utf-8", errors="replace"), default="-")
@click.option("--per-line", is_flag=True, help="Classify each line on its own (one result per line).")
@click.option(
    "--json", "as_json", is_flag=True, help="Print JSON: one object, or one per line with --per-line."
)
@click.option(
    "--rules",
    "rules_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Rules file tried before the built-ins (default: the configured detect.rules_file).",
)
@click.pass_context
def classify(
    ctx: click.Context, source: IO[str], per_line: bool, as_json: bool, rules_file: Path | None
) -> None:
    """Classify a log excerpt (FILE, or - for stdin) into Unicron error statuses."""
    try:
        classifier: Classifier = load_classifier(
            rules_file if rules_file is not None else _configured_rules(ctx)
        )
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    text = source.read()
    if not per_line:
        result = classifier.classify_text(text)
        click.echo(json.dumps(result.to_json()) if as_json else _text(result))
        return
    for number, line in enumerate(text.splitlines(), start=1):
        result = classifier.classify_line(line)
        if as_json:
            click.echo(json.dumps({"line": number, **result.to_json()}))
        else:
            click.echo(f"{number}: {_text(result)}")
