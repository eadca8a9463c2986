"""unicorn's configuration: one TOML file, overridable key by key from the environment.

Precedence, lowest first: the defaults written in the dataclasses below, the TOML file
(``load_config(path)``, else ``$UNICORN_CONFIG``, else no file), then environment
variables named ``UNICORN_<SECTION>__<KEY>`` (double underscore between the parts, e.g.
``UNICORN_REDIS__URL``, ``UNICORN_SLURM__COMMAND_TIMEOUT_S``).

The settings are a tree of frozen dataclasses rooted at ``Config``; every field carries
its unit in its name and documents meaning, default and why in ``metadata["doc"]``
(listed by ``describe()``); numeric bounds are ``metadata`` too (``gt``, ``ge``, ``lt``,
``le``). Loading is generic over the tree: a new section is a new dataclass and a new
field on ``Config``, with no loader changes. Supported field types: ``str``, ``int``,
``float``, ``bool``, ``Literal[...]`` of strings, ``tuple[<one of those>, ...]``, and
nested sections. The root holds only sections (a root key would have no ``__`` in its
environment variable name).

Checks, all reported together in one ``ConfigError``: unknown sections and keys (with
the valid ones listed), wrong types (``int`` is accepted for ``float``, ``bool`` never
for a number), ``Literal`` choices, bounds, then the cross-field checks each section
states in ``problems()``. ``validate()`` runs the same checks on a ``Config`` built in
code.

The package, by who reads what: ``schema`` (field metadata, the ``Section`` base, type
checks, ``SettingInfo``), ``site`` (``[redis]``, ``[slurm]``, ``[log]``: every process),
``node`` (``[agent]``, ``[detect]``, ``[ckpt]``: the compute nodes, and unicornd for the
first two), ``coordinator`` (``[plan]``, ``[recovery]``, ``[ssh]``, ``[alerts]``,
``[metrics]``: unicornd only) and ``loader`` (the ``Config`` root, ``load_config`` and
the generic checks). Import from ``unicorn_core.config``, which re-exports them all.
"""

from unicorn_core.config.coordinator import (
    AlertsConfig,
    LeaderConfig,
    MetricsConfig,
    PlanConfig,
    RecoveryConfig,
    SshConfig,
)
from unicorn_core.config.loader import (
    CONFIG_ENV,
    Config,
    describe,
    load_config,
    read_toml,
    settings_from,
    validate,
)
from unicorn_core.config.node import AgentConfig, CkptConfig, DetectConfig
from unicorn_core.config.schema import ENV_PREFIX, ENV_SEPARATOR, Section, SettingInfo
from unicorn_core.config.site import (
    LogConfig,
    LogFormat,
    LogLevel,
    RedisConfig,
    SlurmBackend,
    SlurmConfig,
    read_secret,
)

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "ENV_SEPARATOR",
    "AgentConfig",
    "AlertsConfig",
    "CkptConfig",
    "Config",
    "DetectConfig",
    "LeaderConfig",
    "LogConfig",
    "LogFormat",
    "LogLevel",
    "MetricsConfig",
    "PlanConfig",
    "RecoveryConfig",
    "RedisConfig",
    "Section",
    "SettingInfo",
    "SlurmBackend",
    "SlurmConfig",
    "SshConfig",
    "describe",
    "load_config",
    "read_secret",
    "read_toml",
    "settings_from",
    "validate",
]
