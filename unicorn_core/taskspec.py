"""Training tasks as the cluster sees them: a name, a weight, GPU bounds and a model.

A task file is TOML::

    name = "gpt3-7b"
    weight = 1.0          # 0.5 .. 2.0, default 1.0
    min_gpus = 8          # below this the task gains nothing (Unicron's T_necessary)
    max_gpus = 64         # optional

    [model]
    layers = 32
    hidden = 4096
    heads = 32
    sequence = 2048
    vocabulary = 50257
    global_batch = 1024
    # optional: ffn_hidden (default 4*hidden), num_query_groups (default heads)

A task *list* file holds several tasks as ``[[task]]`` tables with the same keys (see
:func:`load_tasks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from unicorn_core.config import read_toml
from unicorn_core.errors import ConfigError, InvalidArgument
from unicorn_core.model import ModelSpec

MIN_WEIGHT = 0.5
MAX_WEIGHT = 2.0

_TASK_KEYS = ("name", "weight", "min_gpus", "max_gpus", "model")
_MODEL_REQUIRED = ("layers", "hidden", "heads", "sequence", "vocabulary", "global_batch")
_MODEL_OPTIONAL = ("ffn_hidden", "num_query_groups")


@dataclass(frozen=True)
class TaskSpec:
    """One training task. ``weight`` scales its share of the cluster's weighted FLOP/s."""

    name: str
    model: ModelSpec
    weight: float = 1.0
    min_gpus: int = 1
    max_gpus: int | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise InvalidArgument(f"task name must be a non-empty string, got {self.name!r}")
        if not MIN_WEIGHT <= self.weight <= MAX_WEIGHT:
            raise InvalidArgument(
                f"task {self.name!r}: weight must be in [{MIN_WEIGHT}, {MAX_WEIGHT}], got {self.weight!r}"
            )
        if self.min_gpus < 1:
            raise InvalidArgument(f"task {self.name!r}: min_gpus must be >= 1, got {self.min_gpus!r}")
        if self.max_gpus is not None and self.max_gpus < self.min_gpus:
            raise InvalidArgument(
                f"task {self.name!r}: max_gpus {self.max_gpus!r} is below min_gpus {self.min_gpus!r}"
            )


def _where(path: Path, prefix: str, field: str) -> str:
    return f"{path}: {prefix}{field}"


def _int_field(table: Mapping[str, object], field: str, path: Path, prefix: str) -> int:
    value = table[field]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{_where(path, prefix, field)} must be a positive integer, got {value!r}")
    return value


def _check_keys(table: Mapping[str, object], valid: tuple[str, ...], path: Path, what: str) -> None:
    unknown = sorted(set(table) - set(valid))
    if unknown:
        raise ConfigError(
            f"{path}: unknown {what} key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(valid)}"
        )


def _parse_model(raw: object, path: Path, prefix: str) -> ModelSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{_where(path, prefix, 'model')} must be a table, got {raw!r}")
    _check_keys(raw, _MODEL_REQUIRED + _MODEL_OPTIONAL, path, f"{prefix}model")
    missing = [key for key in _MODEL_REQUIRED if key not in raw]
    if missing:
        raise ConfigError(f"{path}: {prefix}model is missing required field(s) {', '.join(missing)}")
    fields = {key: _int_field(raw, key, path, f"{prefix}model.") for key in raw}
    try:
        return ModelSpec(**fields)
    except InvalidArgument as exc:
        raise ConfigError(f"{path}: {prefix}model: {exc}") from exc


def _parse_task(raw: Mapping[str, object], path: Path, prefix: str) -> TaskSpec:
    _check_keys(raw, _TASK_KEYS, path, f"{prefix or 'task '}".strip())
    for key in ("name", "model"):
        if key not in raw:
            raise ConfigError(f"{path}: {prefix}{key} is required")
    name = raw["name"]
    if not isinstance(name, str) or not name.strip() or any(ch.isspace() for ch in name):
        raise ConfigError(
            f"{_where(path, prefix, 'name')} must be a non-empty string without spaces, got {name!r}"
        )
    weight_raw = raw.get("weight", 1.0)
    if isinstance(weight_raw, bool) or not isinstance(weight_raw, int | float):
        raise ConfigError(f"{_where(path, prefix, 'weight')} must be a number, got {weight_raw!r}")
    weight = float(weight_raw)
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ConfigError(
            f"{_where(path, prefix, 'weight')} must be between {MIN_WEIGHT} and {MAX_WEIGHT}, "
            f"got {weight_raw!r}"
        )
    min_gpus = _int_field(raw, "min_gpus", path, prefix) if "min_gpus" in raw else 1
    max_gpus = _int_field(raw, "max_gpus", path, prefix) if "max_gpus" in raw else None
    if max_gpus is not None and max_gpus < min_gpus:
        raise ConfigError(f"{_where(path, prefix, 'max_gpus')} {max_gpus!r} is below min_gpus {min_gpus!r}")
    model = _parse_model(raw["model"], path, prefix)
    return TaskSpec(name=name, model=model, weight=weight, min_gpus=min_gpus, max_gpus=max_gpus)


def load_task_file(path: str | Path) -> TaskSpec:
    """Parse a single-task file. Raises :class:`ConfigError` naming the bad field."""
    path = Path(path)
    return _parse_task(read_toml(path, "task file"), path, "")


def load_tasks(path: str | Path) -> tuple[TaskSpec, ...]:
    """Parse a single-task file or a task list (``[[task]]`` tables); names must be unique."""
    path = Path(path)
    raw = read_toml(path, "task file")
    if "task" not in raw:
        return (_parse_task(raw, path, ""),)
    _check_keys(raw, ("task",), path, "top-level (task list)")
    entries = raw["task"]
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{path}: task must be a non-empty array of tables ([[task]]), got {entries!r}")
    tasks = tuple(_parse_task(entry, path, f"task[{i}].") for i, entry in enumerate(entries))
    check_unique_names(tasks, str(path))
    return tasks


def check_unique_names(tasks: tuple[TaskSpec, ...], where: str) -> None:
    """Raise :class:`ConfigError` if two tasks share a name."""
    seen: set[str] = set()
    for task in tasks:
        if task.name in seen:
            raise ConfigError(f"{where}: task name {task.name!r} appears more than once")
        seen.add(task.name)
