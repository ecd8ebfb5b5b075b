"""Run-folder figures: sample grids (digits, text-to-image) and the training curves (PNG, matplotlib)."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from steadyrl.rollout.digits import to_unit_range  # noqa: E402


GRID_DPI = 90  # sample grids' resolution: pixels per inch of `grid_figsize`


def grid_figsize(rows: int, columns: int, side: int = 8, labels: list[str] | None = None) -> tuple[float, float]:
    """A sample grid's figure size in inches: 0.6 a cell for 8x8 digits (1.6 for larger images), with room on
    the left for the row labels."""
    cell = 0.6 if side <= 16 else 1.6
    label = 1.2 if labels is None or max(map(len, labels)) <= 8 else 2.2
    return columns * cell + label, rows * cell + 0.6


def save_sample_grid(grid: torch.Tensor, path: Path, title: str, per_class_acc: list[float] | None = None,
                     labels: list[str] | None = None) -> None:
    """grid [rows, n, C, H, W] (C = 1: grey digits; C = 3: RGB) in model space -> one row per class (or prompt),
    labelled with the class (`labels`: each row's own, a class or a prompt) and the gold accuracy if given."""
    classes, n = grid.shape[:2]
    imgs = to_unit_range(grid)
    fig, axes = plt.subplots(classes, n, figsize=grid_figsize(classes, n, grid.shape[-1], labels), squeeze=False)
    for c in range(classes):
        for j in range(n):
            ax = axes[c][j]
            if imgs.shape[2] == 3:
                ax.imshow(imgs[c, j].permute(1, 2, 0).numpy(), interpolation="nearest")
            else:
                ax.imshow(imgs[c, j, 0].numpy(), cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
        label = f"{c}" if labels is None else textwrap.fill(labels[c], 16)
        label = label if per_class_acc is None else f"{label}: {per_class_acc[c]:.0%}"
        short = "\n" not in label and len(label) <= 8  # a class: as the eval grids have it; a prompt: wrapped
        axes[c][0].set_ylabel(label, rotation=0, labelpad=18 if short else 6, fontsize=8 if short else 6,
                              va="center", ha="center" if short else "right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=GRID_DPI)
    plt.close(fig)


def save_image_grid(images: torch.Tensor, captions: list[str], path: Path, title: str, columns: int = 8,
                    max_images: int = 32) -> None:
    """RGB images [B,3,H,W] in [-1, 1] in rows of `columns`, each captioned (prompt and reward)."""
    images = to_unit_range(images[:max_images]).clamp(0, 1)
    n = len(images)
    cols = min(columns, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.6, rows * 1.8 + 0.4), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if i < n:
            ax.imshow(images[i].permute(1, 2, 0).numpy(), interpolation="nearest")
            ax.set_title(captions[i], fontsize=5)
        else:
            ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_curves(rows: list[dict[str, float]], evals: list[dict[str, Any]], path: Path) -> None:
    """Proxy reward, gold accuracy (per step and at evals) and diversity over steps."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["step"] for r in rows]

    def line(ax, key: str, label: str) -> None:
        if rows and key in rows[0]:
            ax.plot(steps, [r.get(key, math.nan) for r in rows], label=label, alpha=0.8)

    line(axes[0], "reward/train_mean", "proxy reward (train batch)")
    line(axes[0], "reward/ensemble_mean", "ensemble mean")
    axes[0].set_title("reward")
    line(axes[1], "reward/held_out", "gold acc. (train batch)")
    if evals:
        axes[1].plot([e["step"] for e in evals], [e["held_out"] for e in evals], "o-", label="gold acc. (eval)")
    axes[1].set_title("gold accuracy (reward hacking check)")
    line(axes[2], "diversity/nn_distance", "nearest-neighbour feature distance")
    if evals:
        axes[2].plot([e["step"] for e in evals], [e["diversity_nn"] for e in evals], "o-", label="eval")
    axes[2].set_title("diversity")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def save_held_out_vs_time(curves: dict[str, list[list[tuple[float, float]]]], target: float | None,
                          path: Path, title: str = "held-out against training time") -> Path:
    """One colour per label (a method, a run), one line per run (a seed) of its (training seconds, held-out)
    points; the target as a dashed line."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (label, runs) in enumerate(curves.items()):
        colour = f"C{i % 10}"
        for j, points in enumerate(runs):
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, color=colour, marker=".", alpha=0.8, label=label if j == 0 else None)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    ax.set_xlabel("seconds of training steps (evaluations and start-up apart)")
    ax.set_ylabel("held-out")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
