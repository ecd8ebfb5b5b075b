"""The controller: the training loop over a runtime's rollout pool and learner.

    for step:  launch rollouts (up to learner.max_staleness steps ahead) -> collect them (sampled and scored)
               -> update the learner -> publish its weights to the pool -> log, evaluate, checkpoint

The runtime is Ray (`services.runtime.ray_runtime`: actors, the Serve reward ensemble, DeepSpeed ranks; batches move as
ObjectRefs and the driver only ever fetches small summaries and evaluation grids) or local
(`services.runtime.local_runtime`: the same interfaces in one process). The loop, metrics, checkpoints and evaluation are this
code for both.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console

from steadyrl.rollout.cache import write_text_atomically
from steadyrl.services.config import ConfigError, TrainConfig, dump_config, load_config
from steadyrl.services.driver.console import progress_bar, summary_table
from steadyrl.services.driver.resume import auto_resume_from, check_resume, record_resume
from steadyrl.services.driver.run_health import RunHealth
from steadyrl.services.run_folder.checkpoints import (ACTORS_FILE, CHECKPOINTS, CONTROLLER_STATE, RunFailed,  # noqa: F401
                                           checkpoint_before, drop_checkpoints_after, latest_checkpoint,
                                           latest_state, new_checkpoint, resume_hint)
from steadyrl.services.run_folder.figures import save_curves
from steadyrl.services.run_folder.metrics import MetricsWriter, read_metrics
from steadyrl.services.run_folder.recoveries import append_recovery
from steadyrl.services.runtime.driver_bytes import DRIVER_FETCHES
from steadyrl.services.runtime.failures import ComponentFailed
from steadyrl.services.runtime.seams import LearnerHandle, RolloutPoolHandle, Runtime
from steadyrl.services.runtime.signals import stop_status
from steadyrl.services.testbeds import build_testbed
from steadyrl.trainer.collapse import Collapse


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    base_eval: dict[str, Any] | None
    final_eval: dict[str, Any] | None
    interrupted: bool = False
    exit_status: int = 0  # 130 after Ctrl-C, 143 after SIGTERM (`signals.stop_status`)
    timing: dict[str, float] = field(default_factory=dict)


def new_run_dir(cfg: TrainConfig) -> Path:
    if cfg.run.run_dir:
        return Path(cfg.run.run_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.run.name}-{stamp}"


class Stopwatch:
    """Wall-clock seconds of named phases, as `timing_s/<phase>` metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"timing_s/{name}"] = time.perf_counter() - t0


def require_ray(what: str, instead: str = "train in this one process without Ray: `steadyrl train --local ...` "
                "(run.runtime=local)") -> None:
    """A clear error, before anything starts, where Ray is not installed (an air-gapped GPU node, say): only the
    Ray runtime and the Serve app need it."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"{what} needs Ray, which is not installed in this Python ({sys.executable}): install it "
                          f"(`pip install 'ray[serve]'`){', or ' + instead if instead else ''}")


def check_can_start(cfg: TrainConfig) -> None:
    """What is known before anything starts or is written, as a ConfigError: every model the run loads is to be
    had (a local directory or the hub cache), and Ray is installed where the runtime is Ray's."""
    build_testbed(cfg).require_models()
    if cfg.run.runtime == "ray":
        require_ray("run.runtime=ray")


def build_runtime(cfg: TrainConfig, testbed, run_dir: Path, console: Console) -> Runtime:
    """The runtime `run.runtime` names: "ray" (actors, Serve, DeepSpeed ranks) or "local" (one process)."""
    if cfg.run.runtime == "local":
        from steadyrl.services.runtime.local_runtime import LocalRuntime

        return LocalRuntime(cfg, testbed, run_dir, console)
    from steadyrl.services.runtime.ray_runtime import RayRuntime  # `check_can_start` made sure Ray is there

    return RayRuntime(cfg, testbed, run_dir, console)


@dataclass
class Recovering:
    """A restart under way: the `restart`-th, after `failure` at wall-clock time `failed_at`."""

    restart: int
    failure: RunFailed
    failed_at: float

    def record(self, run_dir: Path, resumed_from: int, console: Console) -> None:
        """Once the checkpoint is restored: recoveries.jsonl gets the restart, the steps redone (the lost ones and
        the one under way) and the seconds from the failure to training again."""
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "restart": self.restart,
                 "failed_step": self.failure.failed_step, "resumed_from_step": resumed_from,
                 "steps_redone": (self.failure.failed_step or resumed_from) - resumed_from,
                 "recovery_s": round(time.time() - self.failed_at, 3), "cause": self.failure.cause}
        append_recovery(run_dir, entry)
        console.print(f"[yellow]restart {self.restart}: back at step {resumed_from} after {entry['cause']} "
                      f"({entry['steps_redone']} step(s) to redo, {entry['recovery_s']:.0f} s to recover)",
                      soft_wrap=True)


class RollBack(Exception):
    """The health watch flagged a collapse and a checkpoint before it exists: `run` restores it and fits again."""

    def __init__(self, checkpoint: Path, collapse: Collapse, metrics: dict[str, float]):
        super().__init__(f"roll back to {checkpoint}")
        self.checkpoint, self.collapse, self.metrics = checkpoint, collapse, metrics


class Controller:
    def __init__(self, cfg: TrainConfig, run_dir: Path, console: Console | None = None, resume: bool = False,
                 progress: str = "auto", recovering: Recovering | None = None):
        self.cfg = cfg
        self.recovering = recovering  # the failure this run restarts after (`run_restarting`), if any
        self.progress = progress  # how the steps show: "auto" | "bar" | "lines" | "none" (`console.progress_style`)
        self.testbed = build_testbed(cfg)
        self.run_dir = Path(run_dir)
        self.console = console or Console()
        self.resume = resume
        self.runtime: Runtime = build_runtime(cfg, self.testbed, self.run_dir, self.console)
        self.pool: RolloutPoolHandle | None = None  # the runtime's, once `run` has started it
        self.learner: LearnerHandle | None = None
        self.evals: list[dict[str, Any]] = []
        self.version = 0  # learner updates behind the weights last published (= steps done)
        self.steps_done = 0
        self.timing_sums: dict[str, float] = {}
        self.health = RunHealth(cfg.health, self.run_dir, cfg.learner.max_staleness)

    # ---------------------------------------------------------------- the loop
    def run(self) -> RunResult:
        """Start the runtime, evaluate the base (or restore the last checkpoint), `fit` to run.steps (again from a
        healthy checkpoint after each rollback), then shut down and summarise."""
        cfg = self.cfg
        interrupted, exit_status = False, 0
        start = 0
        writer: MetricsWriter | None = None
        try:
            self.pool, self.learner = self.start()
            writer = MetricsWriter(self.run_dir, cfg.run.loggers, cfg.model_dump(mode="json"), self.resume)
            start = self.steps_done = self.restore() if self.resume else 0
            if self.recovering is not None:
                self.recovering.record(self.run_dir, start, self.console)
            if not self.resume:
                self.evaluate(0)
                if cfg.health.rollback.enabled:
                    self.checkpoint(0)  # a collapse in the first updates has somewhere to go back to
            with progress_bar(cfg, self.testbed, self.console, start, self.progress) as bar:
                step = start
                while True:
                    try:
                        self.fit(step, writer, bar)
                        break
                    except RollBack as back:
                        step = self.steps_done = self.roll_back(back.checkpoint, back.collapse)
                        bar(self.steps_done, back.metrics)
        except ComponentFailed as err:
            cause = err.during(self.steps_done + 1)
            raise RunFailed(f"{cause}; nothing after step {self.steps_done} was kept" + resume_hint(self.run_dir),
                            failed_step=self.steps_done + 1, restartable=True, cause=cause) from None
        except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (`signals.Terminated`)
            interrupted, exit_status = True, stop_status(err)
            ckpt = latest_checkpoint(self.run_dir)
            self.console.print(f"[yellow]interrupted after step {self.steps_done}; last checkpoint: "
                               f"{ckpt if ckpt else 'none'} (resume with `steadyrl train --resume {self.run_dir}`)",
                               soft_wrap=True)
        finally:
            if writer is not None:
                writer.close()
            self.runtime.shutdown()
        save_curves(read_metrics(self.run_dir), self.evals, self.run_dir / "curves.png")
        n = max(1, self.steps_done - start)
        result = RunResult(self.run_dir, self.steps_done,
                           self.evals[0] if self.evals and self.evals[0]["step"] == 0 else None,
                           self.evals[-1] if self.evals else None, interrupted, exit_status,
                           {k: v / n for k, v in self.timing_sums.items()})
        if cfg.run.progress:
            self.console.print(summary_table(result.run_dir, result.base_eval, result.final_eval, result.steps_done,
                                             result.timing, self.testbed.labels, self.testbed.headline))
        return result

    def fit(self, start: int, writer: MetricsWriter, bar: Callable[[int, dict[str, float]], None]) -> None:
        """Steps start+1 .. run.steps: train, log, watch the run's health, evaluate and checkpoint when due. A
        collapse with a healthy checkpoint to go back to raises `RollBack`."""
        cfg = self.cfg
        for step in range(start, cfg.run.steps):
            if self.target_reached():
                return
            metrics = self.train_step(step)
            self.steps_done = done = step + 1
            collapse = self.health.watch(done, metrics, self.learner)
            writer.write(done, metrics)
            for k, v in metrics.items():
                if k.startswith("timing_s/"):
                    self.timing_sums[k] = self.timing_sums.get(k, 0.0) + v
            bar(done, metrics)
            target = None if collapse is None else self.healthy_checkpoint(collapse)
            if target is not None:
                raise RollBack(target, collapse, metrics)
            last = done == cfg.run.steps
            if done % cfg.run.eval_every == 0 or last:
                self.evaluate(done)
                last = last or self.target_reached()
            if self.checkpoint_due(done) or last:
                self.checkpoint(done)

    def target_reached(self) -> bool:
        """Whether the latest evaluation (of the step last done) reached `run.target_held_out`: the run ends."""
        target = self.cfg.run.target_held_out
        return (target is not None and bool(self.evals) and self.evals[-1]["step"] == self.steps_done
                and self.evals[-1]["held_out"] >= target)

    def train_step(self, step: int) -> dict[str, float]:
        """launch (up to learner.max_staleness steps ahead) -> collect `step`'s rollouts -> update the learner ->
        publish its weights to the pool; the step's metrics."""
        watch = Stopwatch()
        DRIVER_FETCHES.take()  # what the driver fetched since (evaluations, checkpoints) is not the step's
        with watch.phase("step"):
            self.pool.begin_step()
            self.launch_ahead(step)
            with watch.phase("collect"):
                batches, summaries = self.pool.collect(step)
            metrics = self.learner.update(batches, self.health.controls(step))
            self.version += 1
            with watch.phase("sync"):
                self.pool.publish(self.version)
        return self.step_metrics(metrics, summaries, watch.seconds)

    def launch_ahead(self, step: int) -> None:
        """Pipelining (learner.max_staleness = s): the rollouts of steps `step` .. `step` + s not yet in flight start
        now with the current weights and run while the learner trains; s = 0 is the synchronous loop. A resumed or
        rolled-back run's relaunched rollouts keep the weights they were recorded with."""
        in_flight = self.pool.in_flight()
        for ahead in range(step, min(self.cfg.run.steps, step + self.cfg.learner.max_staleness + 1)):
            if ahead not in in_flight:
                self.pool.launch(ahead)

    # ---------------------------------------------------------------- its pieces
    def start(self) -> tuple[RolloutPoolHandle, LearnerHandle]:
        """The run folder and its config, the testbed's checks, its base model and reward models (built or from the
        cache), then the runtime's pool and learner."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.resume:
            write_text_atomically(self.run_dir / "config.yaml", dump_config(cfg))
        self.testbed.preflight()  # a bad sampler setting, token id or prompt fails here, before Ray starts
        base_model = self.testbed.base_weights(progress=cfg.run.progress)
        with self.console.status("reward models (built and cached on first use)"):
            self.testbed.prepare_rewards(self.console if cfg.run.progress else None)
        return self.runtime.start(base_model)

    def step_metrics(self, metrics: dict[str, float], summaries: list[dict[str, float]],
                     seconds: dict[str, float]) -> dict[str, float]:
        """The learner's metrics, the rollouts' merged summaries, fault counts, the phases' timings and what the
        driver fetched during the step (`handoff/*`, `services.runtime.driver_bytes`; evaluations are counted apart)."""
        metrics.update(merge_summaries(summaries))
        metrics.update(seconds)
        metrics.update(DRIVER_FETCHES.take())
        metrics["faults/rollout_restarts"] = float(self.pool.restarts_this_step)
        metrics["rollout/samples"] = metrics.pop("n")
        metrics["perf/samples_per_s"] = metrics["rollout/samples"] / metrics["timing_s/step"]
        return metrics

    def evaluate(self, step: int) -> dict[str, Any]:
        DRIVER_FETCHES.take()  # the evaluation's fetches are counted apart from the steps'
        result = self.pool.evaluate(self.cfg.run.eval_seed)
        DRIVER_FETCHES.evaluated(step)
        result["step"] = step
        self.testbed.save_eval(result, self.run_dir / f"samples_step_{step:04d}",
                               f"step {step}: {self.testbed.headline_text(result['held_out'])}")
        self.evals.append(result)
        write_text_atomically(self.run_dir / "evals.json", json.dumps(self.evals, indent=1))
        return result

    def checkpoint_due(self, steps_done: int) -> bool:
        rollback = self.cfg.health.rollback
        return steps_done % self.cfg.run.checkpoint_every == 0 or (
            rollback.enabled and steps_done % rollback.checkpoint_every == 0)

    def checkpoint(self, step: int) -> Path:
        """checkpoints/step_N, written atomically: the learner's state, the weights of rollouts in flight
        (pipelining: a resume relaunches them as they were) and the controller's state."""
        with new_checkpoint(self.run_dir, step) as tmp:
            self.learner.save(str(tmp))
            self.pool.save_in_flight(tmp)
            (tmp / CONTROLLER_STATE).write_text(json.dumps({
                "step": step, "evals": len(self.evals), "version": self.version,
                "pending": {str(j): v for j, v in self.pool.in_flight().items()},
                "health": self.health.state_dict()}))
        return self.run_dir / CHECKPOINTS / f"step_{step}"

    def restore(self) -> int:
        """Resume from the latest checkpoint (its health state too); returns its step."""
        ckpt, state = latest_state(self.run_dir)
        if state.get("health"):
            self.health.load_state_dict(state["health"])
        self.load_checkpoint(ckpt, state)
        return int(state["step"])

    def load_checkpoint(self, ckpt: Path, state: dict[str, Any]) -> list[str]:
        """The learner, evaluations, published weights and in-flight rollouts as checkpoint `ckpt` has them;
        metrics.jsonl loses its rows past the checkpoint, which are returned."""
        self.learner.load(str(ckpt))
        evals_path = self.run_dir / "evals.json"
        self.evals = json.loads(evals_path.read_text())[: state["evals"]] if evals_path.exists() else []
        write_text_atomically(evals_path, json.dumps(self.evals, indent=1))
        self.version = int(state.get("version", state["step"]))
        self.pool.publish(self.version)
        self.pool.relaunch(state.get("pending", {}), ckpt)
        # metrics.jsonl may hold steps past the checkpoint: drop them so the log matches the state
        path, dropped = self.run_dir / "metrics.jsonl", []
        if path.exists():
            rows = [r for r in path.read_text().splitlines() if r]
            kept = [r for r in rows if json.loads(r)["step"] <= state["step"]]
            dropped = rows[len(kept):]
            write_text_atomically(path, "".join(r + "\n" for r in kept))
        return dropped

    def healthy_checkpoint(self, collapse: Collapse) -> Path | None:
        """The newest checkpoint before the weights `collapse` blames (None: there is none; the run goes on)."""
        ckpt = checkpoint_before(self.run_dir, collapse.bad_version)
        if ckpt is None:
            self.console.print(f"[yellow]collapse at step {collapse.step} ({'; '.join(collapse.reasons)}) but no "
                               f"checkpoint before step {collapse.bad_version} to roll back to", soft_wrap=True)
            self.health.collapse.rewind(collapse.step)  # the flags start again, not repeated every step
        return ckpt

    def roll_back(self, ckpt: Path, collapse: Collapse) -> int:
        """Restore checkpoint `ckpt` (a healthy one), drop what came after it (rollouts in flight, later
        checkpoints, metric rows: kept in rollbacks/), lower the learning rate; returns its step."""
        state = json.loads((ckpt / CONTROLLER_STATE).read_text())
        self.pool.discard_in_flight()
        drop_checkpoints_after(self.run_dir, int(state["step"]))
        abandoned = self.load_checkpoint(ckpt, state)
        self.health.rolled_back(collapse, int(state["step"]), abandoned)
        # the restored checkpoint now carries the rollback (its lr scale, counts), so a resume from it does not
        # replay the collapse at the old learning rate
        write_text_atomically(ckpt / CONTROLLER_STATE, json.dumps({**state, "health": self.health.state_dict()}))
        self.console.print(f"[red]collapse at step {collapse.step}: {'; '.join(collapse.reasons)}; rolled back to "
                           f"step {state['step']} with the learning rate x{self.health.lr_scale:g} "
                           f"(rollback {self.health.rollbacks}/{self.cfg.health.rollback.max_rollbacks})",
                           soft_wrap=True)
        return int(state["step"])


def merge_summaries(summaries: list[dict[str, float]]) -> dict[str, float]:
    """Sample-weighted mean of the workers' summaries (timings: the slowest worker; counts of faults: the sum)."""
    total = sum(s["n"] for s in summaries)
    out: dict[str, float] = {"n": total}
    for k in summaries[0]:
        if k == "n":
            continue
        if k.startswith("timing_s/"):
            out[k] = max(s[k] for s in summaries)
        elif k.startswith("faults/"):
            out[k] = sum(s[k] for s in summaries)
        else:
            out[k] = sum(s[k] * s["n"] for s in summaries) / total
    return out


def train(config: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
          resume_dir: str | Path | None = None, console: Console | None = None,
          allow_changes: bool = False, progress: str = "auto") -> RunResult:
    """The run behind `steadyrl.train` (services/driver/api.py), and so behind the CLI and `python -m
    steadyrl.services.driver.job`. A resume checks the overrides against the run's config
    (`services.driver.resume`), records them and keeps config.yaml the run's current one. `progress`: the steps'
    display, "auto" | "bar" | "lines" | "none" (`console.progress_style`)."""
    console = console or Console()
    if resume_dir is not None:
        run_dir = Path(resume_dir)
        saved = load_config(run_dir / "config.yaml")
        cfg = load_config(run_dir / "config.yaml", overrides)
        check_can_start(cfg)  # before Ray starts and a resume is recorded
        step = int(latest_state(run_dir)[1]["step"])
        return continue_run(cfg, saved, run_dir, step, allow_changes, console, progress)
    cfg = load_config(config, overrides)
    check_can_start(cfg)  # before Ray starts and the run folder exists
    found = auto_resume_from(cfg) if cfg.run.resume == "auto" else None
    if found is None:
        run_dir = new_run_dir(cfg)
        if cfg.run.resume == "auto" and (run_dir / "metrics.jsonl").exists():  # an attempt that died before its
            (run_dir / "metrics.jsonl").unlink()  # first checkpoint: its rows would precede the new ones
            console.print(f"run.resume=auto: no checkpoint in {run_dir}: the run starts there afresh")
        return run_restarting(cfg, run_dir, console, progress, resume=False)
    run_dir, (saved, step) = Path(cfg.run.run_dir), found
    if step >= cfg.run.steps:
        console.print(f"run.resume=auto: {run_dir} has finished its {step} steps; nothing to do")
        return finished_run(run_dir, step)
    console.print(f"run.resume=auto: continuing {run_dir} from its step-{step} checkpoint")
    return continue_run(cfg, saved, run_dir, step, False, console, progress)


def continue_run(cfg: TrainConfig, saved: TrainConfig, run_dir: Path, step: int, allow_changes: bool,
                 console: Console, progress: str) -> RunResult:
    """Resume the run in `run_dir` (saved with `saved`) from its step-`step` checkpoint under `cfg`: the changes
    checked (`check_resume`) and recorded, config.yaml kept the run's current one."""
    changes = check_resume(saved, cfg, step, allow_changes)
    record_resume(run_dir, step, changes)
    if changes:
        write_text_atomically(run_dir / "config.yaml", dump_config(cfg))
    return run_restarting(cfg, run_dir, console, progress, resume=True)


def run_restarting(cfg: TrainConfig, run_dir: Path, console: Console, progress: str, resume: bool) -> RunResult:
    """The run, restarted from its latest checkpoint each time it loses a process or node it cannot replace in
    place (`RunFailed.restartable`), at most run.max_restarts times: a new runtime on the nodes left, the
    checkpoint restored and the steps since redone (with exact resume, the run the failure never hit)."""
    recovering: Recovering | None = None
    for restart in range(1, cfg.run.max_restarts + 2):
        try:
            return Controller(cfg, run_dir, console, resume=resume, progress=progress, recovering=recovering).run()
        except RunFailed as failure:
            if not failure.restartable or latest_checkpoint(run_dir) is None or restart > cfg.run.max_restarts:
                if failure.restartable and restart > 1:
                    raise RunFailed(f"{failure} (after {restart - 1} restart(s), run.max_restarts="
                                    f"{cfg.run.max_restarts})", failure.failed_step, cause=failure.cause) from None
                raise
            console.print(f"[yellow]{failure.cause}; restarting from the last checkpoint ({restart} of "
                          f"run.max_restarts={cfg.run.max_restarts})", soft_wrap=True)
            recovering, resume = Recovering(restart, failure, time.time()), True
    raise AssertionError("unreachable: the last attempt returns or raises")


def finished_run(run_dir: Path, step: int) -> RunResult:
    """The result of a run that already reached its last step (its evaluations from evals.json)."""
    evals = json.loads((run_dir / "evals.json").read_text()) if (run_dir / "evals.json").exists() else []
    return RunResult(run_dir, step, next((e for e in evals if e["step"] == 0), None), evals[-1] if evals else None)
