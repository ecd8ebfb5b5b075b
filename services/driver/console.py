"""What a run shows on the terminal: the progress of its steps (a live bar, or plain lines where output does not
redraw) and the base-vs-final summary table."""
from __future__ import annotations

import importlib.util
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from steadyrl.services.config import TrainConfig
from steadyrl.services.testbeds.base import Testbed


PROGRESS_STYLES = ("auto", "bar", "lines", "none")


def progress_style(style: str, console: Console) -> str:
    """The style `style` names; "auto" is a live bar where the output redraws in place (a terminal; Jupyter, where
    rich draws it in an ipywidgets output), else plain lines (a file, a pipe, CI logs, a dumb terminal)."""
    if style not in PROGRESS_STYLES:
        raise ValueError(f"progress={style!r}: one of {', '.join(map(repr, PROGRESS_STYLES))}")
    if style != "auto":
        return style
    if console.is_jupyter:
        return "bar" if importlib.util.find_spec("ipywidgets") is not None else "lines"
    return "bar" if console.is_terminal and not console.is_dumb_terminal else "lines"


class ProgressLines:
    """`update(steps_done, metrics)` that prints a plain line (no redrawing, no colour) on the first update, at the
    last step, every tenth of the run, and at least every `every_s` seconds between: the bar's figures, and the
    time since the loop began."""

    def __init__(self, cfg: TrainConfig, testbed: Testbed, console: Console, every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.every_s, self.clock, self.console = cfg.run.steps, every_s, clock, console
        self.stride = max(1, self.total // 10)
        self.labels, self.headline_format = testbed.labels, testbed.headline_format
        self.began, self.last = clock(), None

    def __call__(self, done: int, m: dict[str, float]) -> None:
        now = self.clock()
        if not (self.last is None or done >= self.total or done % self.stride == 0 or now - self.last >= self.every_s):
            return
        self.last = now
        (proxy_label, gold_label), elapsed = self.labels, timedelta(seconds=int(now - self.began))
        gold = format(m["reward/held_out"], self.headline_format)
        self.console.print(f"RL {done}/{self.total}  {proxy_label} {m['reward/train_mean']:.3f}  {gold_label} {gold}  "
                           f"KL {m['policy/kl_ref_monitor']:.1e}  {m['timing_s/step']:.2f}s/step  {elapsed} elapsed",
                           markup=False, highlight=False, soft_wrap=True)


@contextmanager
def progress_bar(cfg: TrainConfig, testbed: Testbed, console: Console, start: int,
                 style: str = "auto") -> Iterator[Callable[[int, dict[str, float]], None]]:
    """Yields `update(steps_done, metrics)` for the run's progress: steps, proxy reward, the held-out figure, KL and
    seconds per step, as a live bar or as plain lines (`progress_style`; off with `run.progress=false` or style
    "none")."""
    style = progress_style(style, console) if cfg.run.progress else "none"
    if style == "lines":
        yield ProgressLines(cfg, testbed, console)
        return
    proxy_label, gold_label = testbed.labels
    progress = Progress(
        TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(),
        TextColumn(proxy_label + " {task.fields[proxy]:.3f}  " + gold_label + " {task.fields[gold]:"
                   + testbed.headline_format + "}  KL {task.fields[kl]:.1e}  {task.fields[dt]:.2f}s/step"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=style == "none",
    )
    with progress:
        task = progress.add_task("rl", total=cfg.run.steps, completed=start, proxy=0.0, gold=0.0, kl=0.0, dt=0.0)
        yield lambda done, m: progress.update(
            task, completed=done, proxy=m["reward/train_mean"], gold=m["reward/held_out"],
            kl=m["policy/kl_ref_monitor"], dt=m["timing_s/step"])


def _percent(value: float, breakdown: bool = False) -> str:
    return format(value, ".0%" if breakdown else ".1%")


def summary_table(run_dir: Path, base: dict[str, Any] | None, final: dict[str, Any] | None, steps_done: int,
                  timing: dict[str, float], labels: tuple[str, str] = ("proxy", "gold"),
                  headline: Callable[..., str] = _percent) -> Table:
    """Base vs final evaluation (`headline` formats the held-out figure: the testbed's `headline`), with the mean
    seconds per step of each phase as its caption."""
    table = Table(title=f"steadyrl run summary  ({run_dir})")
    table.add_column("prompts")
    table.add_column(f"{labels[1]} base", justify="right")
    table.add_column(f"{labels[1]} final", justify="right")
    if base and final:
        for key, b in base["breakdown"].items():
            f = final["breakdown"].get(key)
            table.add_row(key, headline(b, breakdown=True), "-" if f is None else headline(f, breakdown=True))
        table.add_row("[bold]all", f"[bold]{headline(base['held_out'])}", f"[bold]{headline(final['held_out'])}")
        table.add_row(f"{labels[0]} reward", f"{base['proxy_mean']:.3f}", f"{final['proxy_mean']:.3f}")
        table.add_row("diversity (nn)", f"{base['diversity_nn']:.2f}", f"{final['diversity_nn']:.2f}")
    if timing:
        split = "  ".join(f"{k.split('/')[1]} {v:.2f}s" for k, v in sorted(timing.items()))
        table.caption = f"steps {steps_done}; mean per step: {split}"
    return table
