"""Loading and checking the settings, for every process that reads the config.

The ``Config`` root gathering every section; ``load_config`` (the defaults, then the
TOML file, then ``UNICORN_<SECTION>__<KEY>`` environment overrides); ``read_toml``; the
generic ``settings_from`` and ``validate`` that build and check any settings tree
(unknown sections and keys with the valid ones listed, types, choices and bounds, then
each section's cross-field ``problems()``, all reported in one ``ConfigError``); and
``describe``, which lists the leaf settings of ``Config`` by default.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from unicorn_core.config.coordinator import (
    AlertsConfig,
    LeaderConfig,
    MetricsConfig,
    PlanConfig,
    RecoveryConfig,
    SshConfig,
)
from unicorn_core.config.node import AgentConfig, CkptConfig, DetectConfig, memory_versions_needed
from unicorn_core.config.schema import (
    _BOUNDS,
    ENV_PREFIX,
    ENV_SEPARATOR,
    Section,
    SettingInfo,
    _check,
    _describe,
    _expected,
    _is_section,
    _join,
    _meta,
    _MismatchError,
    _noun,
    _show,
    _valid,
)
from unicorn_core.config.site import LogConfig, RedisConfig, SlurmConfig
from unicorn_core.errors import ConfigError

CONFIG_ENV = "UNICORN_CONFIG"
"""Environment variable naming the config file when ``load_config`` gets no path."""


@dataclass(frozen=True, kw_only=True)
class Config(Section):
    """All of unicorn's settings. Build with ``load_config()``; ``Config()`` is the defaults."""

    redis: RedisConfig = field(
        default_factory=RedisConfig, metadata=_meta("Redis connection (coordination state).")
    )
    slurm: SlurmConfig = field(default_factory=SlurmConfig, metadata=_meta("Access to Slurm."))
    agent: AgentConfig = field(default_factory=AgentConfig, metadata=_meta("Per-node agent."))
    detect: DetectConfig = field(default_factory=DetectConfig, metadata=_meta("Failure detection."))
    plan: PlanConfig = field(default_factory=PlanConfig, metadata=_meta("Cluster-wide planning."))
    recovery: RecoveryConfig = field(
        default_factory=RecoveryConfig, metadata=_meta("Error-handling ladder, breakers, drain limiter.")
    )
    ckpt: CkptConfig = field(default_factory=CkptConfig, metadata=_meta("Checkpoint engine."))
    ssh: SshConfig = field(default_factory=SshConfig, metadata=_meta("Out-of-band node probes over SSH."))
    alerts: AlertsConfig = field(
        default_factory=AlertsConfig, metadata=_meta("Alert delivery (command, webhook).")
    )
    metrics: MetricsConfig = field(
        default_factory=MetricsConfig, metadata=_meta("Prometheus endpoint of unicornd.")
    )
    leader: LeaderConfig = field(
        default_factory=LeaderConfig, metadata=_meta("Leader election among unicornd processes.")
    )
    log: LogConfig = field(default_factory=LogConfig, metadata=_meta("Logging."))

    def problems(self) -> list[str]:
        if self.detect.max_hang_factor < self.detect.hang_factor:
            return [
                f"detect.max_hang_factor = {self.detect.max_hang_factor:g} must be >= "
                f"detect.hang_factor = {self.detect.hang_factor:g}"
            ]
        if self.detect.heartbeat_timeout_s <= self.agent.heartbeat_interval_s:
            return [
                f"detect.heartbeat_timeout_s = {self.detect.heartbeat_timeout_s:g} must be greater "
                f"than agent.heartbeat_interval_s = {self.agent.heartbeat_interval_s:g} "
                "(every healthy agent would be declared lost between beats)"
            ]
        needed = memory_versions_needed(self.detect.loss_stop_window, self.ckpt.snapshot_every)
        if self.ckpt.memory_versions and self.ckpt.memory_versions < needed:
            return [
                f"ckpt.memory_versions = {self.ckpt.memory_versions} cannot hold a version older than "
                f"a loss spike (its ranks stop within detect.loss_stop_window = "
                f"{self.detect.loss_stop_window} iterations, "
                f"a snapshot every ckpt.snapshot_every = {self.ckpt.snapshot_every}): needs >= {needed} "
                "(or 0 to derive it), else a roll back past a loss spike finds no version in memory"
            ]
        return []

    def redis_password(self) -> str | None:
        """Shorthand for ``self.redis.password()``."""
        return self.redis.password()


# --------------------------------------------------------------------------- loading

T = TypeVar("T")


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read the config: defaults, then the TOML file, then ``UNICORN_<SECTION>__<KEY>`` vars.

    ``path`` None means ``$UNICORN_CONFIG`` (looked up in ``env``) when set, else no file.
    ``env`` None means ``os.environ``; it is only read. Raises ``ConfigError`` listing
    every problem found, with nothing applied.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    if path is None:
        configured = environ.get(CONFIG_ENV, "")
        path = Path(configured) if configured else None
    data = read_toml(path) if path is not None else {}
    return settings_from(Config, data, environ, source=str(path) if path is not None else "")


def read_toml(path: Path, what: str = "config file") -> dict[str, Any]:
    """Parse one TOML file; ``ConfigError`` naming ``what`` and the file when it is missing or invalid."""
    where = f"{what} {str(path)!r}"
    try:
        with path.open("rb") as stream:
            return tomllib.load(stream)
    except FileNotFoundError as exc:
        raise ConfigError(f"{where}: not found") from exc
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: invalid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text: {exc}") from exc


def settings_from(
    root: type[T], data: Mapping[str, object], env: Mapping[str, str] | None = None, *, source: str = ""
) -> T:
    """Build and check the settings tree ``root`` from parsed TOML ``data`` and ``env``.

    Generic over any tree of frozen dataclasses (``Config`` is one); ``source`` names
    where ``data`` came from, for messages. Raises ``ConfigError`` with every problem.
    """
    errors: list[str] = []
    overrides, origins = _env_overrides(root, env or {}, errors)
    merged = _merge(data, overrides)
    settings = _build(root, merged, "", origins, errors)
    if not errors:
        errors.extend(_cross_field_problems(settings, ""))
    if errors:
        raise _config_error(errors, source)
    return settings


def validate(settings: object) -> None:
    """Run every load-time check on a settings tree built in code (e.g. ``Config(...)``)."""
    if not _is_section(type(settings)):
        raise TypeError(f"expected a settings dataclass, got {type(settings).__name__}")
    data = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}  # type: ignore[arg-type]
    settings_from(type(settings), _as_data(data), {})


def describe(root: type[Any] = Config) -> tuple[SettingInfo, ...]:
    """Every leaf setting of the tree ``root``, in declaration order."""
    return tuple(_describe(root, ""))


# --------------------------------------------------------------------------- internals


def _build(
    cls: type[T], data: Mapping[str, object], path: str, origins: Mapping[str, str], errors: list[str]
) -> T:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = get_type_hints(cls)
    errors.extend(
        f"unknown {_noun(cls)} {_join(path, name)!r}; {_valid(cls)}" for name in data if name not in fields
    )
    values: dict[str, object] = {}
    for name, f in fields.items():
        if name not in data:
            continue
        key, hint, value = _join(path, name), hints[name], data[name]
        origin = f" (from ${origins[key]})" if key in origins else ""
        if _is_section(hint):
            if isinstance(value, Mapping):
                values[name] = _build(hint, value, key, origins, errors)
            else:
                errors.append(f"{key} = {_show(value)}{origin}: expected a table ([{key}])")
            continue
        try:
            checked = _check(value, hint)
        except _MismatchError as exc:
            errors.append(f"{key} = {_show(value)}{origin}: expected {exc.expected}")
            continue
        broken = [
            f"{key} = {_show(value)}{origin}: must be {symbol} {f.metadata[bound_name]:g}"
            for bound_name, (compare, symbol) in _BOUNDS.items()
            if bound_name in f.metadata and not compare(checked, f.metadata[bound_name])
        ]
        errors.extend(broken)
        if not broken:  # an out-of-range value never reaches a constructor that checks it too
            values[name] = checked
    return cls(**values)


def _parse_env(text: str, hint: Any) -> object:
    """An environment variable's text as a value of ``hint``'s type (checked later)."""
    if hint is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1"):
            return True
        if lowered in ("false", "0"):
            return False
        raise _MismatchError("true or false (or 1 or 0)")
    if hint is int:
        try:
            return int(text.strip(), 10)
        except ValueError:
            raise _MismatchError(_expected(hint)) from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise _MismatchError(_expected(hint)) from None
    if get_origin(hint) is tuple:
        items = text.split(",") if text.strip() else []
        return [_parse_env(item.strip(), get_args(hint)[0]) for item in items]
    return text  # str and Literal: as is (choices are checked with the rest)


def _env_overrides(
    root: type[Any], env: Mapping[str, str], errors: list[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """``UNICORN_A__B`` variables as nested data, and which variable set each dotted key."""
    overrides: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name in sorted(env):
        rest = name.removeprefix(ENV_PREFIX)
        if rest == name or ENV_SEPARATOR not in rest:
            continue  # UNICORN_CONFIG, UNICORN_ETC_DIR, ...: not settings
        parts = rest.lower().split(ENV_SEPARATOR)
        cls, target = root, overrides
        for depth, part in enumerate(parts):
            key = ".".join(parts[: depth + 1])
            hints = get_type_hints(cls)
            if part not in {f.name for f in dataclasses.fields(cls)}:
                errors.append(f"unknown {_noun(cls)} {key!r} (from ${name}); {_valid(cls)}")
                break
            hint, last = hints[part], depth == len(parts) - 1
            if _is_section(hint) and last:
                errors.append(f"${name} names the section {key!r}, not a key; {_valid(hint)}")
            elif _is_section(hint):
                cls, target = hint, target.setdefault(part, {})
                continue
            elif not last:
                errors.append(f"${name}: {key!r} is a key, not a section")
            else:
                try:
                    target[part] = _parse_env(env[name], hint)
                    origins[key] = name
                except _MismatchError as exc:
                    errors.append(f"{key} = {_show(env[name])} (from ${name}): expected {exc.expected}")
            break
    return overrides, origins


def _merge(base: Mapping[str, object], overrides: Mapping[str, object]) -> dict[str, object]:
    """``base`` with ``overrides`` laid over it, table by table (neither is changed)."""
    merged = dict(base)
    for key, value in overrides.items():
        below = merged.get(key)
        if isinstance(value, Mapping):
            if below is None:
                merged[key] = _merge({}, value)
            elif isinstance(below, Mapping):
                merged[key] = _merge(below, value)
            # else: the file has a non-table here; that error is reported by _build
        else:
            merged[key] = value
    return merged


def _cross_field_problems(settings: object, path: str) -> Iterator[str]:
    for f in dataclasses.fields(settings):  # type: ignore[arg-type]
        child = getattr(settings, f.name)
        if _is_section(type(child)):
            yield from _cross_field_problems(child, _join(path, f.name))
    if isinstance(settings, Section):
        prefix = f"{path}: " if path else ""
        yield from (prefix + problem for problem in settings.problems())


def _as_data(data: Mapping[str, object]) -> dict[str, object]:
    """A settings tree's field values as plain nested data, as if parsed from TOML."""
    return {
        key: _as_data({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})  # type: ignore[arg-type]
        if _is_section(type(value))
        else value
        for key, value in data.items()
    }


def _config_error(errors: list[str], source: str) -> ConfigError:
    where = f"config {source}" if source else "config"
    if len(errors) == 1:
        return ConfigError(f"{where}: {errors[0]}")
    return ConfigError(f"{where}: {len(errors)} problems: " + "; ".join(errors))
