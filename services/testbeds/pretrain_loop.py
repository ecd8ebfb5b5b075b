"""The supervised loop both language-model pre-trainings share: fixed-size batches of seeded problems, AdamW, a
progress bar; stopped by iteration count, never wall time, so machine load never changes the model."""
from __future__ import annotations

from typing import Callable

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch import Tensor, nn

from steadyrl.rollout.arith import ArithTask


def fit_on_problems(model: nn.Module, task: ArithTask, loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor], *,
                    iterations: int, batch_size: int, lr: float, problem_seed: int, title: str,
                    progress: bool = True, params: list[nn.Parameter] | None = None) -> list[float]:
    """Train `model` in place on `task`'s problems (batch `it` = problems it*B .. (it+1)*B - 1 of `problem_seed`),
    `loss_fn(model, prompts, completions)` per batch; returns the losses. `params`: what trains (default: all)."""
    opt = torch.optim.AdamW(model.parameters() if params is None else params, lr=lr)
    losses: list[float] = []
    with Progress(TextColumn(f"[bold]{title}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), disable=not progress) as bar:
        job = bar.add_task("pretrain", total=iterations, loss=float("nan"))
        for it in range(iterations):
            problems = task.problems(problem_seed, range(it * batch_size, (it + 1) * batch_size))
            loss = loss_fn(model, task.encode_prompts(problems), task.encode_completions(problems))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            bar.update(job, advance=1, loss=sum(losses[-20:]) / len(losses[-20:]))
    return losses
