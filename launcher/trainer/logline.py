"""Megatron-LM's training log line, as ``unicorn-train`` prints it (no torch here).

The field order and number formats follow Megatron-LM's ``training_log``, so tools
that read Megatron logs (and unicorn's own Megatron adapter) read ours too::

     [2026-11-21 06:30:00] iteration       10/     100 | consumed samples:          160 |
     elapsed time per iteration (ms): 41.3 | learning rate: 1.000000E-03 |
     global batch size:    16 | lm loss: 4.123456E+00 | loss scale: 1.0 |
     number of skipped iterations:   0 | number of nan iterations:   0 |

(one line in reality). Megatron averages the elapsed time over the log interval.
"""

from __future__ import annotations

import math
import time


def iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    learning_rate: float,
    global_batch: int,
    lm_loss: float,
    wall_time_s: float | None = None,
) -> str:
    """One Megatron-format iteration line (``wall_time_s`` defaults to now, local time)."""
    stamp = time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(time.time() if wall_time_s is None else wall_time_s)
    )
    nan = 0 if math.isfinite(lm_loss) else 1
    return (
        f" [{stamp}]"
        f" iteration {iteration:8d}/{train_iters:8d} |"
        f" consumed samples: {consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
        f" learning rate: {learning_rate:.6E} |"
        f" global batch size: {global_batch:5d} |"
        f" lm loss: {lm_loss:.6E} |"
        " loss scale: 1.0 |"
        " number of skipped iterations:   0 |"
        f" number of nan iterations: {nan:3d} |"
    )
