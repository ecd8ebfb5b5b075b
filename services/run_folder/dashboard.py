"""PNG figures of a run's health panel (`steadyrl inspect`) and of several runs overlaid (`steadyrl compare`).
Only the panels a run has keys for are drawn; rollbacks (red) and anomaly events (orange, dashed) are vertical
lines on every panel."""
from __future__ import annotations

import math
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from steadyrl.services.run_folder.reader import RunFolder, run_labels  # noqa: E402

# (title, [(key, label)], log-scale y): a panel is drawn when the run has any of its keys
LINE_PANELS: list[tuple[str, list[tuple[str, str]], bool]] = [
    ("proxy vs gold", [("reward/train_mean", "proxy (train batch)"), ("reward/ensemble_mean", "ensemble mean"),
                       ("reward/held_out", "gold / held-out (train batch)"), ("reward/gold_mean", "gold mean"),
                       ("eval/proxy_mean", "proxy (eval)"), ("eval/held_out", "gold (eval)")], False),
    ("KL to the reference", [("policy/kl_ref_monitor", "KL(ref) monitor"), ("policy/kl_weight", "KL weight")], False),
    ("gated / clipped / zero-std fractions", [
        ("gardo/gate_frac", "GARDO gated"), ("policy/clip_frac", "ratio clipped"),
        ("stabledrl/cap_frac", "StableDRL capped"), ("health/zero_std_group_frac", "zero-std groups")], False),
    ("diversity", [("diversity/nn_distance", "nn feature distance"), ("eval/diversity_nn", "nn distance (eval)")],
     False),
    ("controls", [("policy/lr_scale", "lr scale"), ("health/kl_boost", "KL boost"),
                  ("health/rollbacks", "rollbacks (cum.)"), ("health/anomaly_events", "anomaly events (cum.)")],
     False),
]
REWARD_QUANTILE = re.compile(r"^health/reward_(.+)_p50$")
GRAD_MODULE = re.compile(r"^health/grad_norm_(.+)$")


def _band(ax, run: RunFolder, lo: str, mid: str, hi: str, label: str) -> None:
    """p50 line with the p10..p90 band shaded."""
    steps, med = run.series(mid)
    line = ax.plot(steps, med, label=label)[0]
    s_lo, v_lo = run.series(lo)
    s_hi, v_hi = run.series(hi)
    if s_lo == s_hi and s_lo:
        ax.fill_between(s_lo, v_lo, v_hi, color=line.get_color(), alpha=0.2)


def _events(ax, run: RunFolder) -> None:
    for r in run.rollbacks:
        ax.axvline(r["step"], color="tab:red", lw=1.2, alpha=0.8)
    for a in run.anomalies:
        ax.axvline(a["step"], color="tab:orange", lw=1.0, ls="--", alpha=0.8)


def panels(run: RunFolder) -> list:
    """Drawers `f(ax) -> title` for the panels this run has data for."""
    out = []
    reward_models = [m.group(1) for k in run.keys() if (m := REWARD_QUANTILE.match(k))]
    if reward_models:
        def rewards(ax):
            for name in reward_models:
                p = f"health/reward_{name}_p"
                _band(ax, run, p + "10", p + "50", p + "90", name)
            return "reward quantiles per model (p50, p10-p90 band)"
        out.append(rewards)
    if run.has("policy/ratio_mean"):
        def ratio(ax):
            steps, mean = run.series("policy/ratio_mean")
            line = ax.plot(steps, mean, label="mean")[0]
            s_std, std = run.series("policy/ratio_std")
            if s_std == steps:
                ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                color=line.get_color(), alpha=0.2, label="mean +- std")
            ax.plot(*run.series("policy/ratio_max"), ls="--", label="max")
            return "importance ratio"
        out.append(ratio)
    if run.has("health/adv_p50"):
        def advantages(ax):
            _band(ax, run, "health/adv_p10", "health/adv_p50", "health/adv_p90", "p50 (p10-p90 band)")
            ax.plot(*run.series("health/adv_std"), ls="--", label="std")
            return "advantages"
        out.append(advantages)
    modules = [m.group(1) for k in run.keys() if (m := GRAD_MODULE.match(k))]
    if run.has("policy/grad_norm") or modules:
        def grads(ax):
            ax.plot(*run.series("policy/grad_norm"), lw=2, color="black", label="total")
            for name in modules:
                ax.plot(*run.series(f"health/grad_norm_{name}"), lw=0.9, label=name)
            if any(v > 0 for k in ["policy/grad_norm", *[f"health/grad_norm_{n}" for n in modules]]
                   for v in run.series(k)[1]):
                ax.set_yscale("log")
            return "gradient norm (total, per module)"
        out.append(grads)
    for title, keys, log in LINE_PANELS:
        present = [(k, label) for k, label in keys if run.has(k)]
        if present:
            def lines(ax, title=title, present=present, log=log):
                for k, label in present:
                    ax.plot(*run.series(k), "o-" if k.startswith("eval/") else "-", label=label)
                if log:
                    ax.set_yscale("log")
                return title
            out.append(lines)
    return out


def dashboard_figure(run: RunFolder, columns: int = 3):
    """The health panel of one run as a matplotlib figure (a grid of plots); None when the run logged no steps."""
    drawers = panels(run)
    if not drawers:
        return None
    rows = math.ceil(len(drawers) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.4 * rows), squeeze=False)
    for ax, draw in zip(axes.flat, drawers):
        ax.set_title(draw(ax), fontsize=9)
        _events(ax, run)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(drawers):]:
        ax.axis("off")
    marks = f"{len(run.rollbacks)} rollback(s) (red), {len(run.anomalies)} anomaly event(s) (orange, dashed)"
    fig.suptitle(f"{run.name}: training health   [{marks}]", fontsize=11)
    fig.tight_layout()
    return fig


def save_dashboard(run: RunFolder, path: Path) -> Path | None:
    """dashboard_figure as a PNG at `path`; None (nothing written) when the run logged no steps."""
    fig = dashboard_figure(run)
    if fig is None:
        return None
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


DEFAULT_COMPARE: tuple[str, ...] = ("reward/train_mean", "reward/held_out", "eval/held_out", "policy/kl_ref_monitor",
                                    "diversity/nn_distance", "policy/grad_norm")


def save_comparison(runs: list[RunFolder], keys: list[str] | tuple[str, ...], path: Path, columns: int = 3) -> Path:
    """One panel per key, one line per run (labelled by folder name); keys no run has are left out."""
    keys = [k for k in keys if any(r.has(k) for r in runs)]
    rows = max(1, math.ceil(len(keys) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.4 * rows), squeeze=False)
    labels = run_labels(runs)
    for ax, key in zip(axes.flat, keys):
        for run, label in zip(runs, labels):
            if run.has(key):
                ax.plot(*run.series(key), "o-" if key.startswith("eval/") else "-", label=label)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle("compare: " + ", ".join(labels), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
