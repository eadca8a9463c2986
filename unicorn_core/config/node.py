"""Sections the compute nodes run by: the node agent, its detection and the checkpoints.

``[agent]`` (heartbeat interval and TTL, where unicorn-agent and torchrun live,
torchrun's rendezvous), ``[detect]`` (the thresholds for lost heartbeats, hangs and
slowdowns, and extra classification rules) and ``[ckpt]`` (the checkpoint engine's
memory, local-disk, remote and peer tiers). The node agent (``launcher/agent.py``), the
checkpoint agent and the built-in trainer read them; unicornd reads ``[agent]`` and
``[detect]`` too, to launch the agents and to judge their heartbeats by the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unicorn_core.config.schema import Section, _meta


@dataclass(frozen=True, kw_only=True)
class AgentConfig(Section):
    """The per-node agent that supervises training processes and reports heartbeats."""

    heartbeat_interval_s: float = field(
        default=1.0,
        metadata=_meta(
            "Seconds between the heartbeats the node agent writes to Redis. Default 1 s: one "
            "small write per second is cheap and lets a dead node be noticed in seconds.",
            gt=0,
        ),
    )
    heartbeat_ttl_s: float = field(
        default=5.0,
        metadata=_meta(
            "Seconds a heartbeat key lives in Redis before it expires by itself, so a dead "
            "agent's last beat does not linger. Must exceed heartbeat_interval_s, or a live "
            "agent's key would vanish between beats. Default 5 s: five beats.",
            gt=0,
        ),
    )
    bin_dir: str = field(
        default="",
        metadata=_meta(
            "Directory holding unicorn-agent, torchrun and python on the compute nodes. "
            "Empty = the directory of the Python running unicornd (one shared virtual "
            "environment, as on the dev cluster). Default: empty."
        ),
    )
    rendezvous_host: str = field(
        default="",
        metadata=_meta(
            "Address torchrun's nodes meet at. Empty = the first node of the task (its "
            "Slurm name must resolve). The dev cluster sets 127.0.0.1. Default: empty."
        ),
    )
    rendezvous_port_base: int = field(
        default=29500,
        metadata=_meta(
            "First TCP port for torchrun rendezvous; each launch of a task takes the next "
            "one of 1000 (so a relaunch never waits for a port in TIME_WAIT). Default 29500.",
            ge=1024,
        ),
    )

    def problems(self) -> list[str]:
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            return [
                f"heartbeat_ttl_s = {self.heartbeat_ttl_s:g} must be greater than "
                f"heartbeat_interval_s = {self.heartbeat_interval_s:g} "
                "(a live agent's heartbeat would expire between beats)"
            ]
        return []


@dataclass(frozen=True, kw_only=True)
class DetectConfig(Section):
    """Failure detection: lost heartbeats, hangs and slowdowns, loss health."""

    heartbeat_timeout_s: float = field(
        default=1.5,
        metadata=_meta(
            "Seconds without a heartbeat after which a node agent counts as lost. Must "
            "exceed agent.heartbeat_interval_s. Default 1.5 s: with 1 s beats a dead node is "
            "caught within 2 s (Unicron: 5.6 s) and a beat up to 0.5 s late is tolerated; "
            "measured without false alarms under CPU contention (BENCHMARKS.md). Silence "
            "alone never drains a node: unicornd confirms out of band first.",
            gt=0,
        ),
    )
    hang_factor: float = field(
        default=2.0,
        metadata=_meta(
            "A rank silent for longer than this multiple of the learned mean iteration time "
            "counts as hung (a ratio, no unit; must be > 1). Default 2 (Unicron uses 3): "
            "steady training jitters far below 2x; checkpoint steps are excluded or "
            "announced (one rank's notice covers the ranks waiting for it); time a rank spent "
            "runnable but off the CPU (the agents read /proc/<pid>/schedstat) is not counted, "
            "so CPU contention is no hang; a stopped rank is caught in ~2 iterations. "
            "Measured (scripts/bench/detection.py, a CPU hog beside the ranks on 2 cores): "
            "silences up to 3.1x the median iteration were at most 2.3x once the wait was "
            "taken off; two 600 s fault-free runs with 29 checkpoint steps each raised no "
            "alarm, and a SIGSTOP was found in 2.15x the mean iteration (p95 of 10).",
            gt=1,
        ),
    )
    max_hang_factor: float = field(
        default=4.0,
        metadata=_meta(
            "Upper bound of the learned hang factor (a ratio, no unit; >= hang_factor). The "
            "factor in force is 1.25 x the largest iteration-time/mean ratio seen recently, "
            "kept between hang_factor and this: steady training is judged at hang_factor, "
            "a noisy one (shared CPUs, data-loading stalls) at up to this. unicornd judges "
            "16 iterations past the warm-up of each (re)launch at this factor, before their "
            "noise is known. Default 4.",
            gt=1,
        ),
    )
    warmup_iterations: int = field(
        default=2,
        metadata=_meta(
            "Number of first iterations left out of the learned mean iteration time, because "
            "they include compilation, allocator and data-loader warm-up. Default 2.",
            ge=0,
        ),
    )
    loss_warmup: int = field(
        default=20,
        metadata=_meta(
            "Reports of a task's loss (and grad norm) learned before a spike can fire "
            "(detect/losshealth.py). A NaN fires at once. Default 20: the median and noise "
            "scale need a few dozen values; the early fast fall lies below the median, "
            "so it never fires either way.",
            ge=5,
        ),
    )
    loss_window: int = field(
        default=100,
        metadata=_meta(
            "Reports the running loss statistics (median of log loss, MAD of its steps) "
            "are taken over; >= loss_warmup. Default 100: long enough that a spike of a "
            "few reports moves neither, short enough to follow the trend.",
            ge=5,
        ),
    )
    loss_stop_window: int = field(
        default=10,
        metadata=_meta(
            "Iterations from a loss spike's first bad iteration to its ranks being stopped "
            "for the roll back: the spike is found on its own report (a NaN at once), then "
            "decided and relaunched, within a few iterations. The memory tier keeps enough "
            "versions that one is older than this (ckpt.memory_versions). Default 10: the "
            "loop takes 1-3 s and an LLM iteration is seconds; a Megatron-LM job whose log "
            "interval is longer needs at least that interval.",
            ge=1,
        ),
    )
    loss_spike_z: float = field(
        default=8.0,
        metadata=_meta(
            "A loss spike needs log(loss) this many noise scales above the running median "
            "AND loss_spike_ratio. Default 8: tuned on 100 synthetic curves (0.5-4 % noise "
            "with hard batches), no benign report reached z 8 with ratio 1.4; the built-in "
            "trainer's real steps reach 9.5 z at only 1.06x, hence the ratio too.",
            gt=0,
        ),
    )
    loss_spike_ratio: float = field(
        default=1.6,
        metadata=_meta(
            "A loss spike needs the loss this many times the running median (and "
            "loss_spike_z). Default 1.6 (tuning showed 0 benign findings from 1.4): held "
            "out, 0 of 200 synthetic and 0 of 10 real curves fired; 2x spikes were found "
            "in 199/200 synthetic and 47/50 real cases.",
            gt=1,
        ),
    )
    grad_norm_z: float = field(
        default=12.0,
        metadata=_meta(
            "A grad-norm explosion needs log(grad norm) this many noise scales above its "
            "running median AND grad_norm_ratio. Default 12: grad norms jump far more than "
            "losses (5-30 % noise); tuning showed 0 benign findings from z 10.",
            gt=0,
        ),
    )
    grad_norm_ratio: float = field(
        default=4.0,
        metadata=_meta(
            "A grad-norm explosion needs the grad norm this many times its running median "
            "(and grad_norm_z). Default 4: benign reports with z >= 12 stayed under 2.3x. "
            "Held out: 100x explosions found in 197/200 curves, 10x in 97/200 (the "
            "noisiest curves need more).",
            gt=1,
        ),
    )
    max_skipped_iterations: int = field(
        default=50,
        metadata=_meta(
            "Iterations in a row Megatron-LM may skip (its fp16 loss scaler found inf/NaN "
            "gradients) before that is a nan_loss finding. Default 50: while the loss scale "
            "settles from its initial 2^32, some 20 in a row are normal.",
            ge=1,
        ),
    )
    sdc_findings: int = field(
        default=2,
        metadata=_meta(
            "Iterations at which one node's loss or grad norm was anomalous while another "
            "node reported a normal one for the same iteration, within sdc_window "
            "iterations, before it is silent_data_corruption: the paired check runs, and "
            "only its failure drains. Needs per-node losses (not Megatron-LM's last-rank "
            "log, not the built-in trainer's all-reduced loss). Default 2.",
            ge=1,
        ),
    )
    sdc_window: int = field(
        default=1000,
        metadata=_meta(
            "Iterations over which sdc_findings are counted. Default 1000.",
            ge=1,
        ),
    )
    straggler_factor: float = field(
        default=1.5,
        metadata=_meta(
            "A node is slow in a window when its ranks' compute time (their own forward/"
            "backward/optimizer time, waits on peers excluded: IterationTiming.compute_s; "
            "per rank the lower decile of the window, per node its slowest rank's) is at "
            "least this many times the median of the other nodes' of the same pipeline stage "
            "(detect/stragglers.py; a ratio, no unit; must be > 1). Default 1.5: 30 % "
            "per-iteration jitter moves a window's ratio by about 0.15 in log units, 1.5 is "
            "0.41; a node 1.5x slower costs its task up to a third of its throughput.",
            gt=1,
        ),
    )
    straggler_window: int = field(
        default=20,
        metadata=_meta(
            "Training iterations per window of the straggler statistic (per rank, the lower "
            "decile of its compute times in the window; a rank needs half of them). Default "
            "20: checkpoint steps, spikes and bursts of contention that hit fewer than 18 of "
            "them cannot move a lower decile.",
            ge=4,
        ),
    )
    straggler_windows: int = field(
        default=3,
        metadata=_meta(
            "Consecutive slow windows before a node is a straggler, and consecutive normal "
            "windows before it has recovered. Default 3 (60 iterations at the default window).",
            ge=1,
        ),
    )
    straggler_min_nodes: int = field(
        default=3,
        metadata=_meta(
            "Nodes a pipeline stage must span before its nodes are compared (each against the "
            "median of the others). At least 3: of two nodes either may be the slow one, so a "
            "2-node task never convicts either. Default 3.",
            ge=3,
        ),
    )
    straggler_warmup: int = field(
        default=10,
        metadata=_meta(
            "Training iterations of a rank after each (re)start left out of the straggler "
            "statistic (compilation, allocator and cache warm-up). Default 10.",
            ge=0,
        ),
    )
    rules_file: str = field(
        default="",
        metadata=_meta(
            "Path of a TOML file of extra classification rules ([[rule]] tables, see "
            "detect/rules.py), tried before the built-in rules; a rule named like a built-in "
            "replaces it. Empty = built-in rules only. Default: empty."
        ),
    )
    nearest_lines: bool = field(
        default=False,
        metadata=_meta(
            "Name the cause of a non-zero exit no rule explains by the most similar labelled "
            "corpus line (detect/nearest.py; always SEV2, a status that never isolates only as a "
            "hint). Off by default: on the two blind sets it was measured on it changed no "
            "exit's status for the better (BENCHMARKS.md). Default false."
        ),
    )

    def problems(self) -> list[str]:
        if self.loss_window < self.loss_warmup:
            return [f"loss_window = {self.loss_window} must be >= loss_warmup = {self.loss_warmup}"]
        return []


def memory_versions_needed(stop_window: int, snapshot_every: int) -> int:
    """Versions the memory tier must keep to always hold one older than a loss spike: the
    ranks stop at most ``stop_window`` iterations after the spike's first bad iteration
    (``detect.loss_stop_window``), a version is saved every ``snapshot_every``, so
    ``ceil(window / every)`` of them can be newer than the spike and one more is older. 2
    (the writer's default) without periodic snapshots."""
    if snapshot_every <= 0:
        return 2
    return -(-stop_window // snapshot_every) + 1


@dataclass(frozen=True, kw_only=True)
class CkptConfig(Section):
    """The checkpoint engine as the node agent and the built-in trainer run it (``ckpt/``)."""

    shm_dir: str = field(
        default="/dev/shm/unicorn-ckpt",  # noqa: S108 - the memory tier is a tmpfs by design
        metadata=_meta(
            "Host-memory tier: ranks copy their snapshots under <shm_dir>/snap and the agent "
            "keeps its ring predecessors' copies under <shm_dir>/peer. A tmpfs so a snapshot "
            "costs a memory copy and survives the rank's crash. Best a tmpfs of its own "
            "mounted huge=within_size (or huge=advise): restores then map 2 MiB pages, ~3x "
            "faster than /dev/shm's 4 KiB ones. The Slurm Epilog frees a job's folders when "
            "it ends. Empty = no memory tier (the trainer saves only to --save-dir). "
            "{node} stands for the node's name (nodes sharing one machine, as the dev "
            "cluster's, keep apart tiers). Default: /dev/shm/unicorn-ckpt."
        ),
    )
    local_dir: str = field(
        default="/var/tmp/unicorn-ckpt",  # noqa: S108 - node-local disk, kept across reboots
        metadata=_meta(
            "Local-disk tier: the agent persists every sealed snapshot here (survives a "
            "reboot, not a lost disk). Empty = no local tier. {node} stands for the node's "
            "name. Default: /var/tmp/unicorn-ckpt (kept across reboots, unlike /tmp)."
        ),
    )
    remote_dir: str = field(
        default="",
        metadata=_meta(
            "Remote tier: a shared file system path every node mounts; the agent persists "
            "every sealed snapshot here too. Empty = off. Default: empty (the trainer's "
            "--save-dir, written with torch.distributed.checkpoint, stays the persistent tier)."
        ),
    )
    keep_versions: int = field(
        default=3,
        metadata=_meta(
            "Iterations kept per tier (local, remote, peer backups), oldest evicted first; "
            "the latest complete one is never evicted. Default 3: the newest, and two to fall "
            "back to if it turns out incomplete.",
            ge=1,
        ),
    )
    memory_versions: int = field(
        default=0,
        metadata=_meta(
            "Versions the memory tier keeps (each rank's snapshot slots in shm and the peer "
            "backups), so that a roll back past a loss spike or NaN finds one older than the "
            "spike there. 0 = derived: ceil(detect.loss_stop_window / snapshot_every) + 1, "
            "the fewest that always hold a version older than the spike (default 10 / 10 + "
            "1 = 2); a value below that is refused. Costs versions x "
            "the node's share of model and optimizer state in host memory. With "
            "snapshot_every = 0 nothing is derived (2). Default 0.",
            ge=0,
        ),
    )
    peer_factor: int = field(
        default=1,
        metadata=_meta(
            "Number of next nodes of the task (ring order) each agent copies its snapshots "
            "to; 0 = no replication. Capped at the task's nodes minus one. Default 1 (TRANSOM's "
            "ring backup): survives the loss of any one node.",
            ge=0,
        ),
    )
    peer_rate_mib_s: float = field(
        default=256.0,
        metadata=_meta(
            "MiB/s at most that one agent sends to its peers, so replication does not compete "
            "with training traffic. Default 256 (about 2 Gbit/s, a small share of a training "
            "network).",
            gt=0,
        ),
    )
    peer_port_base: int = field(
        default=31000,
        metadata=_meta(
            "First TCP port of the agents' replication servers: the agent of node i (its "
            "index in the job's node list) of job J listens on base + (97*J + i) % 1000, so "
            "every agent can compute its peers' ports. Default 31000.",
            ge=1024,
            le=64535,
        ),
    )
    peer_host: str = field(
        default="",
        metadata=_meta(
            "Address the replication servers listen on and are reached at. Empty = every "
            "node's Slurm name (which must resolve), listening on all interfaces. The dev "
            "cluster sets 127.0.0.1. Default: empty."
        ),
    )
    snapshot_every: int = field(
        default=10,
        metadata=_meta(
            "Iterations between the built-in trainer's memory snapshots (besides the save "
            "interval and the SIGUSR1/SIGTERM just-in-time saves); 0 = only those. A "
            "snapshot blocks a rank for about one memory copy, so this can be far shorter "
            "than a disk save interval. Default 10.",
            ge=0,
        ),
    )

    def memory_keep(self, stop_window: int) -> int:
        """The memory tier's versions: ``memory_versions``, or when 0 the fewest that hold a
        version older than a loss spike stopped within ``stop_window`` iterations
        (:func:`memory_versions_needed`). ``Config`` refuses an explicit value below that."""
        return self.memory_versions or memory_versions_needed(stop_window, self.snapshot_every)
