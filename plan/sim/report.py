"""Compare policies on one trace: against the ideal, against each other, losses by cause, a plot.

Every policy is measured against the same limit: the ideal, i.e. the same tasks with no
failures on their best layouts in the planner's best allocation (``fraction_of_ideal``).
The trace's ``node_bound_fraction`` is the most any policy could reach on it (the best
allocation of the nodes up at every instant, recovering for free). Ratios are to
``megatron`` (``ratios``) and from ``unicorn`` to every other policy (``unicorn_vs``).

Reported work is in weighted PFLOP/s x hours (weighted TFLOP / 3.6e6), as in the issue.
matplotlib is imported only inside :func:`plot_png`, so the library needs no plotting stack.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from plan.sim.costs import ElasticCosts, MegatronCosts, UnicornCosts
from plan.sim.engine import Cause, SimResult, node_bound_wtflop, simulate
from plan.sim.policies import Workload, make_policy
from plan.sim.trace import HOUR_S, Trace
from unicorn_core.errors import InvalidArgument

REFERENCE = "megatron"
SUBJECT = "unicorn"
WTFLOP_PER_PFLOPS_H = 1e3 * HOUR_S  # 1 PFLOP/s for one hour, in TFLOP

JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]


def pflops_h(wtflop: float) -> float:
    """Weighted TFLOP -> weighted PFLOP/s x hours."""
    return wtflop / WTFLOP_PER_PFLOPS_H


def run_policies(
    trace: Trace,
    workload: Workload,
    names: Sequence[str],
    *,
    unicorn: UnicornCosts | None = None,
    megatron: MegatronCosts | None = None,
    elastic: ElasticCosts | None = None,
    spare_nodes: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, SimResult]:
    """Replay ``trace`` under each named policy (duplicates are run once)."""
    if not names:
        raise InvalidArgument("no policy to simulate")
    out: dict[str, SimResult] = {}
    for name in dict.fromkeys(names):
        policy = make_policy(
            name, workload, unicorn=unicorn, megatron=megatron, elastic=elastic, spare_nodes=spare_nodes
        )
        out[name] = simulate(trace, workload, policy, progress)
    return out


def ratios(results: Mapping[str, SimResult], reference: str = REFERENCE) -> dict[str, float]:
    """Accumulated WAF of each policy / that of ``reference`` (empty when it was not run or earned 0)."""
    ref = results.get(reference)
    if ref is None or ref.accumulated_wtflop <= 0:
        return {}
    return {name: r.accumulated_wtflop / ref.accumulated_wtflop for name, r in results.items()}


def unicorn_vs(results: Mapping[str, SimResult], subject: str = SUBJECT) -> dict[str, float]:
    """Accumulated WAF of ``subject`` / that of every other policy that earned anything."""
    own = results.get(subject)
    if own is None:
        return {}
    return {
        name: own.accumulated_wtflop / r.accumulated_wtflop
        for name, r in results.items()
        if name != subject and r.accumulated_wtflop > 0
    }


def summary_json(
    trace: Trace, results: Mapping[str, SimResult], workload: Workload | None = None, digits: int = 3
) -> dict[str, JsonValue]:
    """``{"trace", "ideal_waf", "policies": {NAME: {...}}, "ratios", "unicorn_vs"}``.

    Work is in weighted PFLOP/s x h; ``lost_share`` splits 1 - ``fraction_of_ideal`` by
    cause. ``workload`` adds the trace's ``node_bound_fraction``.
    """
    policies: dict[str, JsonValue] = {}
    ideal = 0.0
    for name, r in results.items():
        ideal = r.ideal_wtflop
        lost: dict[str, JsonValue] = {c.value: round(pflops_h(r.lost_wtflop[c]), digits) for c in Cause}
        share: dict[str, JsonValue] = {c.value: round(r.lost_wtflop[c] / r.ideal_wtflop, 4) for c in Cause}
        policies[name] = {
            "accumulated_waf": round(pflops_h(r.accumulated_wtflop), digits),
            "fraction_of_ideal": round(r.fraction_of_ideal, 4),
            "failure_free_fraction": round(r.own_waf_tflops / r.ideal_waf_tflops, 4),
            "lost_by_cause": lost,
            "lost_share": share,
            "mean_waf_pflops": round(r.accumulated_wtflop / r.duration_s / 1e3, digits + 1),
            "decisions": r.decisions,
        }
    counts: dict[str, JsonValue] = {k.value: v for k, v in trace.counts().items()}
    info: dict[str, JsonValue] = {
        "name": trace.name,
        "nodes": trace.nodes,
        "duration_h": trace.duration_s / HOUR_S,
        **counts,
    }
    if workload is not None and ideal > 0:
        info["node_bound_fraction"] = round(node_bound_wtflop(trace, workload) / ideal, 4)
    return {
        "trace": info,
        "ideal_waf": round(pflops_h(ideal), digits),
        "policies": policies,
        "ratios": {k: round(v, 4) for k, v in ratios(results).items()},
        "unicorn_vs": {k: round(v, 4) for k, v in unicorn_vs(results).items()},
    }


def summary_text(trace: Trace, results: Mapping[str, SimResult]) -> str:
    """A table: accumulated WAF, ratio to megatron, losses by cause."""
    counts = trace.counts()
    lines = [
        f"{trace.name}: {trace.nodes} nodes, {trace.duration_s / HOUR_S / 24:.1f} days, "
        + ", ".join(f"{n} {k.value}" for k, n in counts.items()),
        f"  {'policy':10s} {'acc. WAF':>10s} {'of ideal':>8s} {'ratio':>7s} {'steady':>8s} "
        f"{'detection':>10s} {'transition':>10s} {'sub-healthy':>11s}   (weighted PFLOP/s x h)",
    ]
    rel = ratios(results)
    for name, r in results.items():
        ratio = f"{rel[name]:7.3f}" if name in rel else "      -"
        lost = r.lost_wtflop
        lines.append(
            f"  {name:10s} {pflops_h(r.accumulated_wtflop):10.1f} {r.fraction_of_ideal:8.4f} {ratio} "
            f"{pflops_h(lost[Cause.STEADY_STATE]):8.1f} "
            f"{pflops_h(lost[Cause.DETECTION]):10.1f} {pflops_h(lost[Cause.TRANSITION]):10.1f} "
            f"{pflops_h(lost[Cause.SUB_HEALTHY]):11.1f}"
        )
    if results:
        ideal = next(iter(results.values())).ideal_wtflop
        lines.append(f"  ideal (no failures, best layouts): {pflops_h(ideal):.1f}")
    return "\n".join(lines)


def plot_png(results: Mapping[str, SimResult], path: Path, title: str) -> None:
    """WAF and accumulated WAF over time per policy (like Unicron's Figure 11), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, r in results.items():
        days = [t / HOUR_S / 24 for t in (*r.times_s, r.duration_s)]
        rates = [w / 1e3 for w in (*r.waf_tflops, r.waf_tflops[-1] if r.waf_tflops else 0.0)]
        top.step(days, rates, where="post", label=name, linewidth=1)
        acc, total = [0.0], 0.0
        for i, w in enumerate(r.waf_tflops):
            end = r.times_s[i + 1] if i + 1 < len(r.times_s) else r.duration_s
            total += w * (end - r.times_s[i])
            acc.append(pflops_h(total))
        bottom.plot([0.0, *days[1:]], acc, label=name, linewidth=1.2)
    top.set_ylabel("WAF (weighted PFLOP/s)")
    top.set_title(title)
    top.legend(loc="lower left", fontsize="small")
    bottom.set_ylabel("accumulated WAF\n(weighted PFLOP/s x h)")
    bottom.set_xlabel("time (days)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise InvalidArgument(f"cannot write plot {str(path)!r}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
