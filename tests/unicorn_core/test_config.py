"""unicorn_core.config: defaults, file and env layering, and every kind of rejection."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from unicorn_core.config import (
    CONFIG_ENV,
    AgentConfig,
    Config,
    DetectConfig,
    RedisConfig,
    SlurmConfig,
    describe,
    load_config,
    settings_from,
    validate,
)
from unicorn_core.errors import ConfigError
from unicorn_core.paths import etc_dir

REDIS_KEYS = (
    "agent_acl, connect_timeout_s, key_prefix, master_name, operator_password_file, password_file, "
    "sentinel_password_file, sentinels, socket_timeout_s, stream_retention_s, url, user_password_file, "
    "wait_replicas, wait_timeout_ms"
)
SECTIONS = ", ".join(sorted(f.name for f in dataclasses.fields(Config)))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "unicorn.toml"
    path.write_text(text, encoding="utf-8")
    return path


def load_text(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Config:
    return load_config(write(tmp_path, text), env=env or {})


# --------------------------------------------------------------------------- defaults


def test_no_file_no_env_gives_defaults() -> None:
    config = load_config(env={})
    assert config == Config()
    assert config.redis.url == "redis://127.0.0.1:6379/0"
    assert config.redis.key_prefix == "unicorn"
    assert config.redis.socket_timeout_s == 5.0
    assert config.redis.connect_timeout_s == 2.0
    assert config.slurm.backend == "auto"
    assert config.slurm.command_timeout_s == 30.0
    assert config.agent.heartbeat_interval_s == 1.0
    assert config.agent.heartbeat_ttl_s == 5.0
    assert config.detect.heartbeat_timeout_s == 1.5
    assert config.detect.hang_factor == 2.0
    assert config.detect.warmup_iterations == 2
    assert (config.log.level, config.log.format) == ("info", "auto")


def test_defaults_pass_validation() -> None:
    validate(Config())


def test_every_setting_is_documented() -> None:
    infos = describe()
    assert infos, "describe() lists the settings"
    for info in infos:
        assert len(info.doc) > 20, info.key
        assert info.env_var == "UNICORN_" + info.key.upper().replace(".", "__")
    for f in dataclasses.fields(Config):
        assert f.metadata.get("doc"), f.name


def test_describe_states_bounds_and_choices() -> None:
    infos = {info.key: info for info in describe()}
    assert infos["redis.socket_timeout_s"].expected == "a number > 0"
    assert infos["detect.hang_factor"].expected == "a number > 1"
    assert infos["detect.warmup_iterations"].expected == "an integer >= 0"
    assert infos["slurm.backend"].expected == 'one of "auto", "cli", "pyslurm"'
    assert infos["slurm.backend"].default == "auto"


# --------------------------------------------------------------------------- shipped file


def shipped_toml() -> Path:
    return etc_dir() / "unicorn.toml"


def test_shipped_file_is_exactly_the_defaults() -> None:
    assert load_config(shipped_toml(), env={}) == Config()


def test_shipped_file_names_every_key_with_a_comment() -> None:
    text = shipped_toml().read_text(encoding="utf-8")
    data = tomllib.loads(text)
    lines = text.splitlines()
    for info in describe():
        section, key = info.key.split(".")
        assert key in data.get(section, {}), f"{info.key} missing from etc/unicorn.toml"
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{key} = "))
        assert lines[index - 1].startswith("#"), f"{info.key} has no comment above it"
    assert sorted(data) == SECTIONS.split(", ")


# --------------------------------------------------------------------------- layering


def test_file_overrides_defaults_and_keeps_the_rest(tmp_path: Path) -> None:
    config = load_text(
        tmp_path,
        """
        [redis]
        url = "redis://db.example:6380/2"
        socket_timeout_s = 7   # an int is fine for a float key
        [slurm]
        backend = "cli"
        [detect]
        warmup_iterations = 5
        """,
    )
    assert config.redis.url == "redis://db.example:6380/2"
    assert config.redis.socket_timeout_s == 7.0
    assert isinstance(config.redis.socket_timeout_s, float)
    assert config.redis.key_prefix == "unicorn"
    assert config.slurm.backend == "cli"
    assert config.detect.warmup_iterations == 5
    assert config.agent == AgentConfig()


def test_env_overrides_file_with_types_parsed(tmp_path: Path) -> None:
    env = {
        "UNICORN_REDIS__URL": "rediss://secure:6379/0",
        "UNICORN_SLURM__COMMAND_TIMEOUT_S": "60",
        "UNICORN_DETECT__HANG_FACTOR": "2.5",
        "UNICORN_DETECT__WARMUP_ITERATIONS": "0",
        "UNICORN_LOG__FORMAT": "json",
    }
    config = load_text(tmp_path, '[slurm]\ncommand_timeout_s = 10.0\nbackend = "cli"\n', env)
    assert config.redis.url == "rediss://secure:6379/0"
    assert config.slurm.command_timeout_s == 60.0
    assert config.slurm.backend == "cli"
    assert config.detect.hang_factor == 2.5
    assert config.detect.warmup_iterations == 0
    assert config.log.format == "json"


def test_env_vars_without_double_underscore_are_not_settings() -> None:
    env = {"UNICORN_DEV_CLUSTER_DIR": "/x", "UNICORN_ETC_DIR": "/y", "PATH": "/bin", "UNICORN_X": "1"}
    assert load_config(env=env) == Config()


def test_unicorn_config_env_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[agent]\nheartbeat_ttl_s = 9\n")
    assert load_config(env={CONFIG_ENV: str(path)}).agent.heartbeat_ttl_s == 9.0


def test_explicit_path_wins_over_unicorn_config(tmp_path: Path) -> None:
    path = write(tmp_path, "[agent]\nheartbeat_ttl_s = 9\n")
    assert load_config(path, env={CONFIG_ENV: str(tmp_path / "missing.toml")}).agent.heartbeat_ttl_s == 9.0


def test_load_does_not_touch_env(tmp_path: Path) -> None:
    env = {"UNICORN_REDIS__KEY_PREFIX": "test", CONFIG_ENV: str(write(tmp_path, ""))}
    before = dict(env)
    assert load_config(env=env).redis.key_prefix == "test"
    assert env == before


# --------------------------------------------------------------------------- unknown names


def test_unknown_key_in_file_lists_valid_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, '[redis]\nuri = "redis://x"\n')
    assert f"unknown key 'redis.uri'; valid keys: {REDIS_KEYS}" in str(info.value)
    assert str(tmp_path) in str(info.value)


def test_unknown_section_in_file_lists_valid_sections(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"unknown section 'redi'; valid sections: {SECTIONS}"):
        load_text(tmp_path, "[redi]\nurl = 1\n")


def test_unknown_key_in_env_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"UNICORN_REDIS__URI": "redis://x"})
    message = str(info.value)
    assert "unknown key 'redis.uri'" in message
    assert "UNICORN_REDIS__URI" in message
    assert f"valid keys: {REDIS_KEYS}" in message


def test_unknown_section_in_env_lists_valid_sections() -> None:
    with pytest.raises(ConfigError, match=f"unknown section 'redi'.*valid sections: {SECTIONS}"):
        load_config(env={"UNICORN_REDI__URL": "x"})


@pytest.mark.parametrize("name", ["UNICORN_REDIS__", "UNICORN_REDIS__URL__HOST", "UNICORN_AGENT__"])
def test_env_names_that_are_not_keys_are_rejected(name: str) -> None:
    with pytest.raises(ConfigError, match=name.removesuffix("__").split("__")[0]):
        load_config(env={name: "x"})


def test_section_given_a_scalar_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"redis = 5: expected a table"):
        load_text(tmp_path, "redis = 5\n")


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[redis]\nsocket_timeout_s = "abc"', 'redis.socket_timeout_s = "abc": expected a number'),
        ("[redis]\nurl = 6379", "redis.url = 6379: expected a string"),
        ("[detect]\nwarmup_iterations = 2.5", "detect.warmup_iterations = 2.5: expected an integer"),
        ("[detect]\nhang_factor = nan", "detect.hang_factor = nan: expected a finite number"),
        ("[agent]\nheartbeat_ttl_s = [1, 2]", "agent.heartbeat_ttl_s = [1, 2]: expected a number"),
    ],
)
def test_wrong_type_in_file_quotes_value_and_expectation(tmp_path: Path, toml: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, toml + "\n")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[redis]\nsocket_timeout_s = true", "redis.socket_timeout_s = true: expected a number"),
        ("[detect]\nwarmup_iterations = false", "detect.warmup_iterations = false: expected an integer"),
    ],
)
def test_bool_is_never_a_number(tmp_path: Path, toml: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, toml + "\n")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("UNICORN_REDIS__SOCKET_TIMEOUT_S", "abc", 'redis.socket_timeout_s = "abc"'),
        ("UNICORN_DETECT__WARMUP_ITERATIONS", "2.5", 'detect.warmup_iterations = "2.5"'),
        ("UNICORN_DETECT__WARMUP_ITERATIONS", "true", 'detect.warmup_iterations = "true"'),
    ],
)
def test_wrong_type_in_env_names_var_and_value(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={name: value})
    assert message in str(info.value)
    assert f"${name}" in str(info.value)


def test_literal_choices_are_listed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, '[slurm]\nbackend = "slurmrestd"\n')
    assert 'slurm.backend = "slurmrestd": expected one of "auto", "cli", "pyslurm"' in str(info.value)
    with pytest.raises(ConfigError, match=r'log\.level = "loud" .*expected one of "debug", "info"'):
        load_config(env={"UNICORN_LOG__LEVEL": "loud"})


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[redis]\nsocket_timeout_s = 0", "redis.socket_timeout_s = 0: must be > 0"),
        ("[slurm]\ncommand_timeout_s = -1.5", "slurm.command_timeout_s = -1.5: must be > 0"),
        ("[detect]\nhang_factor = 1", "detect.hang_factor = 1: must be > 1"),
        ("[detect]\nwarmup_iterations = -1", "detect.warmup_iterations = -1: must be >= 0"),
    ],
)
def test_bounds(tmp_path: Path, toml: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, toml + "\n")
    assert message in str(info.value)


def test_all_problems_are_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, '[redis]\nuri = 1\nsocket_timeout_s = "x"\n', {"UNICORN_LOG__FORMAT": "xml"})
    message = str(info.value)
    assert "3 problems" in message
    assert "'redis.uri'" in message
    assert "redis.socket_timeout_s" in message
    assert "log.format" in message


# --------------------------------------------------------------------------- cross-field


def test_ttl_must_exceed_heartbeat_interval(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="agent: heartbeat_ttl_s = 1 must be greater than"):
        load_text(tmp_path, "[agent]\nheartbeat_interval_s = 1.0\nheartbeat_ttl_s = 1.0\n")


def test_heartbeat_timeout_must_exceed_heartbeat_interval() -> None:
    env = {"UNICORN_AGENT__HEARTBEAT_INTERVAL_S": "4", "UNICORN_AGENT__HEARTBEAT_TTL_S": "10"}
    with pytest.raises(ConfigError, match=r"detect.heartbeat_timeout_s = 1.5 must be greater than agent"):
        load_config(env=env)


def test_redis_url_scheme_is_checked_without_leaking_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"UNICORN_REDIS__URL": "http://user:hunter2@db:6379/0"})
    assert "redis: url" in str(info.value)
    assert "hunter2" not in str(info.value)


def test_password_in_url_and_password_file_conflict() -> None:
    env = {"UNICORN_REDIS__URL": "redis://:pw@db/0", "UNICORN_REDIS__PASSWORD_FILE": "/run/secret"}
    with pytest.raises(ConfigError, match="password_file"):
        load_config(env=env)


def test_validate_checks_configs_built_in_code() -> None:
    with pytest.raises(ConfigError, match=re.escape("agent.heartbeat_interval_s = -1: must be > 0")):
        validate(Config(agent=AgentConfig(heartbeat_interval_s=-1)))
    with pytest.raises(ConfigError, match="heartbeat_ttl_s"):
        validate(Config(agent=AgentConfig(heartbeat_interval_s=2.0, heartbeat_ttl_s=2.0)))
    with pytest.raises(ConfigError, match=r'slurm.backend = "rest"'):
        validate(Config(slurm=SlurmConfig(backend="rest")))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- files


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"{missing}.*not found"):
        load_config(missing, env={})


def test_missing_file_from_unicorn_config(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="not found"):
        load_config(env={CONFIG_ENV: str(missing)})


def test_invalid_toml_names_the_path(tmp_path: Path) -> None:
    path = write(tmp_path, "[redis\nurl = \n")
    with pytest.raises(ConfigError, match=f"{path}.*invalid TOML"):
        load_config(path, env={})


def test_directory_is_not_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_config(tmp_path, env={})


# --------------------------------------------------------------------------- immutability


def test_config_is_frozen() -> None:
    config = load_config(env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.redis = RedisConfig(url="redis://other/0")  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.detect.hang_factor = 9.0  # type: ignore[misc]
    changed = dataclasses.replace(config, detect=DetectConfig(hang_factor=4.0))
    assert changed.detect.hang_factor == 4.0
    assert config.detect.hang_factor == 2.0


def test_each_load_returns_a_new_equal_config() -> None:
    first, second = load_config(env={}), load_config(env={})
    assert first == second
    assert first is not second
    assert hash(first) == hash(second)


# --------------------------------------------------------------------------- password file


def test_password_file(tmp_path: Path) -> None:
    secret = tmp_path / "redis.pw"
    secret.write_text("s3cret\n", encoding="utf-8")
    config = load_config(env={"UNICORN_REDIS__PASSWORD_FILE": str(secret)})
    assert config.redis_password() == "s3cret"
    assert Config().redis_password() is None


def test_unreadable_password_file(tmp_path: Path) -> None:
    config = Config(redis=RedisConfig(password_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=r"redis.password_file .*missing.*cannot read"):
        config.redis_password()
    empty = tmp_path / "empty"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="empty"):
        Config(redis=RedisConfig(password_file=str(empty))).redis_password()


# --------------------------------------------------------------------------- generic tree


@dataclass(frozen=True, kw_only=True)
class _Inner:
    enabled: bool = field(default=False, metadata={"doc": "a switch"})
    nodes: tuple[str, ...] = field(default=(), metadata={"doc": "node names"})
    mode: Literal["a", "b"] = field(default="a", metadata={"doc": "a mode"})
    ratio: float = field(default=0.5, metadata={"doc": "a ratio", "ge": 0, "le": 1})


@dataclass(frozen=True, kw_only=True)
class _Tree:
    inner: _Inner = field(default_factory=_Inner, metadata={"doc": "the section"})


@pytest.mark.parametrize(("text", "expected"), [("true", True), ("1", True), ("FALSE", False), ("0", False)])
def test_generic_bool_from_env(text: str, expected: bool) -> None:
    assert settings_from(_Tree, {}, {"UNICORN_INNER__ENABLED": text}).inner.enabled is expected


def test_generic_bool_rejects_other_text_and_numbers() -> None:
    with pytest.raises(ConfigError, match=r'inner.enabled = "yes" .*expected true or false'):
        settings_from(_Tree, {}, {"UNICORN_INNER__ENABLED": "yes"})
    with pytest.raises(ConfigError, match=re.escape("inner.enabled = 1: expected true or false")):
        settings_from(_Tree, {"inner": {"enabled": 1}})


def test_generic_tuple_from_file_and_env() -> None:
    assert settings_from(_Tree, {"inner": {"nodes": ["n1", "n2"]}}).inner.nodes == ("n1", "n2")
    assert settings_from(_Tree, {}, {"UNICORN_INNER__NODES": "n1, n2"}).inner.nodes == ("n1", "n2")
    assert settings_from(_Tree, {}, {"UNICORN_INNER__NODES": ""}).inner.nodes == ()
    with pytest.raises(ConfigError, match=r'inner.nodes = \["n1", 2\]: expected a list, each item a string'):
        settings_from(_Tree, {"inner": {"nodes": ["n1", 2]}})


def test_generic_upper_bound() -> None:
    with pytest.raises(ConfigError, match=re.escape("inner.ratio = 1.5: must be <= 1")):
        settings_from(_Tree, {"inner": {"ratio": 1.5}})


def test_generic_describe() -> None:
    keys = [info.key for info in describe(_Tree)]
    assert keys == ["inner.enabled", "inner.nodes", "inner.mode", "inner.ratio"]


def test_recovery_section_sets_the_daemons_policy(tmp_path: Path) -> None:
    path = tmp_path / "unicorn.toml"
    path.write_text("[recovery]\nmax_drain_fraction = 0.5\nmin_drains_per_window = 2\n")
    cfg = load_config(path, env={"UNICORN_RECOVERY__SETTLE_S": "3"})
    assert (cfg.recovery.max_drain_fraction, cfg.recovery.settle_s) == (0.5, 3.0)
    assert cfg.recovery.drain_limit(10) == 5 and cfg.recovery.drain_limit(2) == 2
    path.write_text("[recovery]\nmax_drain_fraction = 1.5\ndrain_everything = true\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path, env={})
    assert "recovery.max_drain_fraction = 1.5: must be <= 1" in str(ei.value)
    assert "unknown key 'recovery.drain_everything'" in str(ei.value)


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"UNICORN_REDIS__SENTINELS": "127.0.0.1:26379,nohost"}, 'sentinels entry "nohost" is not HOST:PORT'),
        ({"UNICORN_REDIS__SENTINELS": "h:0"}, 'sentinels entry "h:0" is not HOST:PORT'),
        (
            {"UNICORN_REDIS__SENTINELS": "h:26379", "UNICORN_REDIS__URL": "unix:///run/redis.sock"},
            "url is a unix socket",
        ),
        ({"UNICORN_REDIS__SENTINELS": "h:26379", "UNICORN_REDIS__MASTER_NAME": " "}, "master_name is empty"),
        ({"UNICORN_REDIS__WAIT_REPLICAS": "1"}, "wait_replicas is set without sentinels"),
        ({"UNICORN_REDIS__WAIT_REPLICAS": "-1"}, "wait_replicas"),
    ],
)
def test_sentinel_settings_are_checked(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(problem)):
        load_config(None, env=env)


def test_sentinel_endpoints_parse() -> None:
    cfg = load_config(None, env={"UNICORN_REDIS__SENTINELS": "10.0.0.1:26379, [::1]:26380"}).redis
    assert cfg.sentinel_endpoints() == [("10.0.0.1", 26379), ("::1", 26380)]
