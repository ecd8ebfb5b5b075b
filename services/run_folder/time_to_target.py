"""Time to a target: how long a run took until its held-out evaluation first reached a level, read back from the
run folder (evals.json and metrics.jsonl). What a user waits for is a good model, not a number of steps.

    step      = the first evaluated step s with eval[s].held_out >= target
    train_s   = sum of timing_s/step over the logged steps up to s   (rollout + reward + update + sync; start-up,
                evaluations and checkpoints apart; steps redone after a rollback or restart counted again)
    samples   = sum of rollout/samples over the same steps

The crossing is placed to the evaluation grid (`run.eval_every`): it is the first evaluation at or above the target.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from steadyrl.services.run_folder.reader import RunFolder


@dataclass(frozen=True)
class TimeToTarget:
    target: float
    reached: bool
    step: int | None  # the first evaluated step at or above the target (None: not reached)
    train_s: float | None  # seconds of training steps up to it
    samples: int | None  # rollout samples drawn up to it
    best: float  # the best held-out of the run's evaluations (nan: none)
    best_step: int | None
    evals: int  # evaluations the run made

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        if self.reached:
            return (f"{self.target:.1%} held-out at step {self.step}: {self.train_s:.1f} s of training, "
                    f"{self.samples} samples")
        best = "no evaluation" if self.best_step is None else f"best {self.best:.1%} at step {self.best_step}"
        return f"{self.target:.1%} held-out not reached ({best})"


def time_to_target(run: RunFolder, target: float) -> TimeToTarget:
    """The run's time to `target` held-out (formulas in the module docstring)."""
    evals = [e for e in run.evals if isinstance(e.get("held_out"), (int, float))]
    best = max(evals, key=lambda e: e["held_out"], default=None)
    crossing = next((e for e in evals if e["held_out"] >= target), None)
    common = dict(target=target, best=math.nan if best is None else float(best["held_out"]),
                  best_step=None if best is None else int(best["step"]), evals=len(evals))
    if crossing is None:
        return TimeToTarget(reached=False, step=None, train_s=None, samples=None, **common)
    step = int(crossing["step"])
    last = max((i for i, row in enumerate(run.metrics) if row.get("step") == step), default=-1)
    rows = run.metrics[: last + 1]  # file order: steps a rollback or restart redid are counted again
    return TimeToTarget(reached=True, step=step, train_s=sum(float(r.get("timing_s/step", 0.0)) for r in rows),
                        samples=int(sum(float(r.get("rollout/samples", 0.0)) for r in rows)), **common)


def held_out_curve(run: RunFolder) -> list[tuple[float, float]]:
    """(seconds of training steps up to the evaluated step, held-out) for each of the run's evaluations."""
    seconds, at_step = 0.0, {0: 0.0}
    for row in run.metrics:
        seconds += float(row.get("timing_s/step", 0.0))
        at_step[int(row["step"])] = seconds  # the last pass over a step: the one its kept evaluation followed
    return [(at_step[int(e["step"])], float(e["held_out"])) for e in run.evals
            if isinstance(e.get("held_out"), (int, float)) and int(e["step"]) in at_step]
