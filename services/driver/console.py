"""What a run shows on the terminal: the progress bar of its steps and the base-vs-final summary table."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from steadyrl.services.config import TrainConfig
from steadyrl.services.testbeds.base import Testbed


@contextmanager
def progress_bar(cfg: TrainConfig, testbed: Testbed, console: Console,
                 start: int) -> Iterator[Callable[[int, dict[str, float]], None]]:
    """Yields `update(steps_done, metrics)` for the run's bar: steps, proxy reward, the held-out figure, KL and
    seconds per step (off with `run.progress=false`)."""
    proxy_label, gold_label = testbed.labels
    progress = Progress(
        TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(),
        TextColumn(proxy_label + " {task.fields[proxy]:.3f}  " + gold_label + " {task.fields[gold]:"
                   + testbed.headline_format + "}  KL {task.fields[kl]:.1e}  {task.fields[dt]:.2f}s/step"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not cfg.run.progress,
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
