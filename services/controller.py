"""The controller (driver): sample -> score -> update -> sync -> log/checkpoint, over actor handles.

Training batches move as ObjectRefs from rollout workers to the learner and weights from the
learner to the workers; the driver only ever fetches small summaries and evaluation grids.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import ray
from ray import serve
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from safetensors.torch import load_file

from steadyrl.rollout.cache import write_text_atomically
from steadyrl.services.actors import RolloutWorker
from steadyrl.services.config import TrainConfig, dump_config, load_config
from steadyrl.services.report import MetricsWriter, read_metrics, save_curves
from steadyrl.services.reward_app import APP_NAME, ROUTE_PREFIX, deploy_reward_app
from steadyrl.services.learner_group import LearnerGroup
from steadyrl.services.runtime import init_ray, start_serve
from steadyrl.services.testbeds import build_testbed

CHECKPOINTS = "checkpoints"


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    base_eval: dict[str, Any] | None
    final_eval: dict[str, Any] | None
    interrupted: bool = False
    timing: dict[str, float] = field(default_factory=dict)


def new_run_dir(cfg: TrainConfig) -> Path:
    if cfg.run.run_dir:
        return Path(cfg.run.run_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.run.name}-{stamp}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / CHECKPOINTS / "latest"
    if not pointer.exists():
        return None
    path = Path(run_dir) / CHECKPOINTS / pointer.read_text().strip()
    return path if path.exists() else None


class Controller:
    def __init__(self, cfg: TrainConfig, run_dir: Path, console: Console | None = None, resume: bool = False):
        self.cfg = cfg
        self.testbed = build_testbed(cfg)
        self.run_dir = Path(run_dir)
        self.console = console or Console()
        self.resume = resume
        self.evals: list[dict[str, Any]] = []
        self._ray_mode = "existing"
        self._started_serve = False

    # ---------------------------------------------------------------- set-up / tear-down
    def setup(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.resume:
            write_text_atomically(self.run_dir / "config.yaml", dump_config(cfg))
        self.base_model = self.testbed.base_weights(progress=cfg.run.progress)
        with self.console.status("reward models (built and cached on first use)"):
            self.testbed.prepare_rewards(self.console if cfg.run.progress else None)
        with self.console.status("starting Ray, the Serve reward ensemble and the DeepSpeed learner"):
            self._ray_mode = init_ray(cfg.ray.address, cfg.ray.num_cpus)
            self._started_serve, self.port = start_serve(cfg.serve, self.run_dir / "logs" / "serve")
            deploy_reward_app(self.testbed.reward_spec(), cfg.serve)
            cfg_dict = cfg.model_dump(mode="json")
            # the base weights travel through the object store: no node but the driver's needs the cache
            base_weights = ray.put(load_file(str(self.base_model)))
            self.learner = LearnerGroup(cfg, base_weights, self.run_dir)
            n = cfg.ray.rollout_workers
            self.workers = [
                RolloutWorker.options(num_cpus=cfg.ray.actor_cpus, num_gpus=cfg.ray.rollout_gpus).remote(
                    cfg_dict, base_weights, i, n, str(self.run_dir))
                for i in range(n)
            ]
            # wait until every actor is up (surfaces init errors here, not at the first step)
            ray.get([*self.learner.ready(), *[w.ready.remote() for w in self.workers]])
        self.reward_url = f"http://{cfg.serve.host}:{self.port}{ROUTE_PREFIX}"
        write_text_atomically(self.run_dir / "endpoints.json", json.dumps({"reward": self.reward_url}))
        if cfg.run.progress:
            self.console.print(f"reward ensemble: {self.reward_url}/docs   "
                               f"run folder: {self.run_dir}   logs: {self.run_dir / 'logs'}")

    def shutdown(self) -> None:
        """Stop what this run started; a Ray or Serve that was already running is left up."""
        if not ray.is_initialized():
            return
        if self._ray_mode == "local":
            ray.shutdown()  # the whole local Ray goes, Serve and every actor with it
            return
        for actor in getattr(self, "workers", []):
            ray.kill(actor)
        if hasattr(self, "learner"):
            self.learner.kill()
        if self._started_serve:  # Serve is detached: on a shared cluster it would outlive the job
            serve.shutdown()
        elif APP_NAME in serve.status().applications:  # the app may never have been deployed
            serve.delete(APP_NAME)
        if self._ray_mode == "joined":
            ray.shutdown()

    # ---------------------------------------------------------------- pieces of a step
    def sync_weights(self) -> float:
        t0 = time.perf_counter()
        weights = self.learner.weights()  # an ObjectRef: the driver never fetches the tensors
        ray.get([w.set_weights.remote(weights) for w in self.workers])
        return time.perf_counter() - t0

    def evaluate(self, step: int) -> dict[str, Any]:
        result = ray.get(self.workers[0].evaluate.remote(self.cfg.run.eval_seed))
        result["step"] = step
        self.testbed.save_eval(result, self.run_dir / f"samples_step_{step:04d}",
                               f"step {step}: {self.testbed.headline_text(result['gold_accuracy'])}")
        self.evals.append(result)
        write_text_atomically(self.run_dir / "evals.json", json.dumps(self.evals, indent=1))
        return result

    def checkpoint(self, step: int) -> Path:
        """Write checkpoints/step_N atomically (temp dir + rename), then move the `latest` pointer."""
        root = self.run_dir / CHECKPOINTS
        final = root / f"step_{step}"
        tmp = root / f".step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.learner.save(str(tmp))
        (tmp / "controller.json").write_text(json.dumps({"step": step, "evals": len(self.evals)}))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        write_text_atomically(root / "latest", final.name)
        return final

    def restore(self) -> int:
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.run_dir / CHECKPOINTS}")
        self.learner.load(str(ckpt))
        state = json.loads((ckpt / "controller.json").read_text())
        evals_path = self.run_dir / "evals.json"
        self.evals = json.loads(evals_path.read_text())[: state["evals"]] if evals_path.exists() else []
        self.sync_weights()
        # metrics.jsonl may hold steps past the checkpoint: drop them so the log matches the state
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            rows = [r for r in path.read_text().splitlines() if r and json.loads(r)["step"] <= state["step"]]
            write_text_atomically(path, "".join(r + "\n" for r in rows))
        return int(state["step"])

    # ---------------------------------------------------------------- the loop
    def run(self) -> RunResult:
        cfg = self.cfg
        interrupted = False
        start = steps_done = 0
        writer: MetricsWriter | None = None
        timing_sums: dict[str, float] = {}
        try:
            self.setup()
            writer = MetricsWriter(self.run_dir)
            start = self.restore() if self.resume else 0
            if not self.resume:
                self.evaluate(0)
            steps_done = start
            proxy_label, gold_label = self.testbed.labels
            progress = Progress(
                TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(),
                TextColumn(proxy_label + " {task.fields[proxy]:.3f}  " + gold_label + " {task.fields[gold]:"
                           + self.testbed.headline_format + "}  "
                           "KL {task.fields[kl]:.1e}  {task.fields[dt]:.2f}s/step"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, disable=not cfg.run.progress,
            )
            with progress:
                task = progress.add_task("rl", total=cfg.run.steps, completed=start, proxy=0.0, gold=0.0, kl=0.0,
                                         dt=0.0)
                for step in range(start, cfg.run.steps):
                    t0 = time.perf_counter()
                    outs = [w.generate.remote(step) for w in self.workers]
                    batch_refs = [o[0] for o in outs]
                    metrics_refs = self.learner.update(*batch_refs)
                    summaries = ray.get([o[1] for o in outs])
                    metrics = ray.get(metrics_refs)[0]  # every rank's, equal: rank 0's
                    metrics["timing_s/sync"] = self.sync_weights()
                    metrics.update(merge_summaries(summaries))
                    metrics["timing_s/step"] = time.perf_counter() - t0
                    metrics["perf/samples_per_s"] = metrics.pop("n") / metrics["timing_s/step"]
                    steps_done = step + 1
                    writer.write(steps_done, metrics)
                    for k, v in metrics.items():
                        if k.startswith("timing_s/"):
                            timing_sums[k] = timing_sums.get(k, 0.0) + v
                    progress.update(task, completed=steps_done, proxy=metrics["reward/train_mean"],
                                    gold=metrics["reward/gold_accuracy"], kl=metrics["policy/kl_ref_monitor"],
                                    dt=metrics["timing_s/step"])
                    last = steps_done == cfg.run.steps
                    if steps_done % cfg.run.eval_every == 0 or last:
                        self.evaluate(steps_done)
                    if steps_done % cfg.run.checkpoint_every == 0 or last:
                        self.checkpoint(steps_done)
        except KeyboardInterrupt:
            interrupted = True
            ckpt = latest_checkpoint(self.run_dir)
            self.console.print(f"[yellow]interrupted after step {steps_done}; last checkpoint: "
                               f"{ckpt if ckpt else 'none'} (resume with `steadyrl train --resume {self.run_dir}`)",
                               soft_wrap=True)
        finally:
            if writer is not None:
                writer.close()
            self.shutdown()
        save_curves(read_metrics(self.run_dir), self.evals, self.run_dir / "curves.png")
        n = max(1, steps_done - start)
        timing = {k: v / n for k, v in timing_sums.items()}
        result = RunResult(self.run_dir, steps_done, self.evals[0] if self.evals and self.evals[0]["step"] == 0 else None,
                           self.evals[-1] if self.evals else None, interrupted, timing)
        if cfg.run.progress:
            self.console.print(summary_table(result, self.testbed.labels, self.testbed.headline))
        return result


def merge_summaries(summaries: list[dict[str, float]]) -> dict[str, float]:
    """Sample-weighted mean of the workers' summaries (timings: the slowest worker)."""
    total = sum(s["n"] for s in summaries)
    out: dict[str, float] = {"n": total}
    for k in summaries[0]:
        if k == "n":
            continue
        if k.startswith("timing_s/"):
            out[k] = max(s[k] for s in summaries)
        else:
            out[k] = sum(s[k] * s["n"] for s in summaries) / total
    return out


def _percent(value: float, breakdown: bool = False) -> str:
    return format(value, ".0%" if breakdown else ".1%")


def summary_table(result: RunResult, labels: tuple[str, str] = ("proxy", "gold"),
                  headline: Callable[..., str] = _percent) -> Table:
    """Base vs final evaluation (`headline` formats the held-out figure: the testbed's `headline`)."""
    table = Table(title=f"steadyrl run summary  ({result.run_dir})")
    table.add_column("prompts")
    table.add_column(f"{labels[1]} base", justify="right")
    table.add_column(f"{labels[1]} final", justify="right")
    base, final = result.base_eval, result.final_eval
    if base and final:
        for key, b in base["breakdown"].items():
            f = final["breakdown"].get(key)
            table.add_row(key, headline(b, breakdown=True), "-" if f is None else headline(f, breakdown=True))
        table.add_row("[bold]all", f"[bold]{headline(base['gold_accuracy'])}", f"[bold]{headline(final['gold_accuracy'])}")
        table.add_row(f"{labels[0]} reward", f"{base['proxy_mean']:.3f}", f"{final['proxy_mean']:.3f}")
        table.add_row("diversity (nn)", f"{base['diversity_nn']:.2f}", f"{final['diversity_nn']:.2f}")
    if result.timing:
        split = "  ".join(f"{k.split('/')[1]} {v:.2f}s" for k, v in sorted(result.timing.items()))
        table.caption = f"steps {result.steps_done}; mean per step: {split}"
    return table


def train(config: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
          resume_dir: str | Path | None = None, console: Console | None = None) -> RunResult:
    """Entry point shared by the CLI and `python -m steadyrl.services.job`."""
    if resume_dir is not None:
        run_dir = Path(resume_dir)
        cfg = load_config(run_dir / "config.yaml", overrides)
        return Controller(cfg, run_dir, console, resume=True).run()
    cfg = load_config(config, overrides)
    return Controller(cfg, new_run_dir(cfg), console).run()
