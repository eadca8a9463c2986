"""The environment and working directory of a job's training command.

Slurm users expect ``srun``'s default ``--export=ALL``: the training sees the variables
exported where the job was submitted (PATH, PYTHONPATH, HF_HOME, NCCL_*,
CUDA_DEVICE_MAX_CONNECTIONS, ...) and runs in the job's working directory. unicorn's
agents are started by unicornd, not by the job, so the sbatch wrapper captures both at
registration (:func:`capture`), unicornd stores them under ``keys.job_env(job)`` (never in
the snapshot, which every user may read), and each agent applies them to the training
command it starts. Variables that describe the batch step rather than the job (Slurm's
own, the GPUs bound to the batch step, torchrun's rank variables, unicorn's settings)
are left out: the agent's step has its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from unicorn_core.errors import InvalidArgument

MAX_BYTES: Final = 256 * 1024
"""Largest environment accepted (names and values together)."""
MAX_VARIABLES: Final = 2048

_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DROP_PREFIXES: Final = (
    "SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SPANK_", "UNICORN_", "BASH_FUNC_", "TORCHELASTIC_",
    "PMI_", "PMIX_",
)  # fmt: skip
_DROP: Final = frozenset(
    {
        # the shell's and the batch step's own
        "PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME",
        # devices bound to the batch step, not to the agent's step
        "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ZE_AFFINITY_MASK",
        # torchrun sets these per rank; inherited ones would make torchrun look like a rank
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "MASTER_ADDR", "MASTER_PORT",
    }
)  # fmt: skip


def passes(name: str) -> bool:
    """Whether the variable ``name`` of the job's environment reaches the training command."""
    return name not in _DROP and not name.startswith(_DROP_PREFIXES)


@dataclass(frozen=True)
class JobEnvironment:
    """Working directory and exported variables of a job's training command."""

    cwd: str
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.cwd, str) or not self.cwd.startswith("/") or "\0" in self.cwd:
            raise InvalidArgument(f"job environment: cwd must be an absolute path, got {self.cwd!r}")
        if not isinstance(self.env, Mapping):
            raise InvalidArgument("job environment: env must be a mapping of names to strings")
        if len(self.env) > MAX_VARIABLES:
            raise InvalidArgument(f"job environment: {len(self.env)} variables, at most {MAX_VARIABLES}")
        size = 0
        for name, value in self.env.items():
            if not isinstance(name, str) or _NAME.fullmatch(name) is None:
                raise InvalidArgument(f"job environment: invalid variable name {name!r}")
            if not isinstance(value, str) or "\0" in value:
                raise InvalidArgument(f"job environment: {name} must be a string without NUL")
            if not passes(name):
                raise InvalidArgument(f"job environment: {name} is the step's own, not the job's")
            size += len(name.encode()) + len(value.encode())
        if size > MAX_BYTES:
            raise InvalidArgument(f"job environment: {size} bytes, at most {MAX_BYTES}")

    def to_dict(self) -> dict[str, object]:
        return {"cwd": self.cwd, "env": dict(self.env)}

    @classmethod
    def from_dict(cls, doc: object) -> JobEnvironment:
        """Validating constructor (InvalidArgument on anything malformed)."""
        if not isinstance(doc, Mapping) or set(doc) != {"cwd", "env"}:
            raise InvalidArgument("job environment: expected an object with exactly 'cwd' and 'env'")
        env = doc["env"]
        if not isinstance(env, Mapping):
            raise InvalidArgument("job environment: env must be an object")
        return cls(cwd=doc["cwd"], env=dict(env))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobEnvironment:
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise InvalidArgument(f"job environment: not JSON: {e}") from None
        return cls.from_dict(doc)


def capture(environ: Mapping[str, str], cwd: str) -> JobEnvironment:
    """What the training command should inherit of this process's environment."""
    kept = {k: v for k, v in environ.items() if passes(k) and _NAME.fullmatch(k) and "\0" not in v}
    return JobEnvironment(cwd=cwd, env=kept)
