"""GPU types as data: ``etc/gpus.toml`` parsed into :class:`GpuSpec` values."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path

from unicorn_core.errors import ConfigError, InvalidArgument
from unicorn_core.paths import etc_dir


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU type (see ``etc/gpus.toml`` for their sources)."""

    name: str
    peak_bf16_tflops: float
    hbm_gib: float
    hbm_tb_s: float
    nvlink_gb_s: float
    network_gb_s: float

    @property
    def nvlink_one_way_gb_s(self) -> float:
        """NVLink bandwidth in one direction (the datasheet counts both)."""
        return self.nvlink_gb_s / 2.0


_NUMBER_FIELDS = tuple(f.name for f in fields(GpuSpec) if f.name != "name")


def parse_gpus(text: str, source: str) -> dict[str, GpuSpec]:
    """Parse the ``gpus.toml`` format: one table per GPU type, all fields positive numbers."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    gpus: dict[str, GpuSpec] = {}
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {name} must be a table, got {table!r}")
        unknown = sorted(set(table) - set(_NUMBER_FIELDS))
        if unknown:
            raise ConfigError(
                f"{source}: {name}: unknown key(s) {unknown}; valid keys: {', '.join(_NUMBER_FIELDS)}"
            )
        values: dict[str, float] = {}
        for key in _NUMBER_FIELDS:
            if key not in table:
                raise ConfigError(f"{source}: {name}.{key} is required")
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"{source}: {name}.{key} must be a positive number, got {value!r}")
            values[key] = float(value)
        gpus[name] = GpuSpec(name=name, **values)
    return gpus


@cache
def _load(path: Path) -> dict[str, GpuSpec]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read GPU table: {exc.strerror or exc}") from exc
    return parse_gpus(text, str(path))


def load_gpus(path: Path | None = None) -> dict[str, GpuSpec]:
    """All GPU types in ``path`` (default ``etc/gpus.toml``)."""
    return dict(_load(path or etc_dir() / "gpus.toml"))


def gpu_spec(name: str, path: Path | None = None) -> GpuSpec:
    """One GPU type by its command-line name (e.g. ``h100-80g``)."""
    gpus = load_gpus(path)
    try:
        return gpus[name]
    except KeyError:
        raise InvalidArgument(f"unknown GPU type {name!r}; known: {', '.join(sorted(gpus))}") from None
