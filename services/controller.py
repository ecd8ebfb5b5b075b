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
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from safetensors.torch import load_file

from steadyrl.rollout.cache import write_text_atomically
from steadyrl.services.actors import RolloutWorker, write_weights
from steadyrl.services.config import TrainConfig, dump_config, load_config
from steadyrl.services.resume import check_resume, record_resume
from steadyrl.services.retry import first_line
from steadyrl.services.report import MetricsWriter, read_metrics, save_curves
from steadyrl.services.reward_app import APP_NAME, ROUTE_PREFIX, deploy_reward_app
from steadyrl.services.learner_group import LearnerGroup, reserve_bundles
from steadyrl.services.runtime import init_ray, start_serve
from steadyrl.services.testbeds import build_testbed

CHECKPOINTS = "checkpoints"
ACTORS_FILE = "actors.json"


class RunFailed(RuntimeError):
    """A failure the run cannot recover from (a learner rank died, a worker past its retries); the message says
    what happened and how to resume from the last checkpoint."""


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
        self._deployed_app = False  # this run deployed the reward app (not found already serving its ensemble)
        self._weights: Any = None  # ObjectRef of the weights last synced (None: the base weights)
        self.version = 0  # updates behind the weights last synced (= steps done)
        # rollouts launched and not yet collected: step -> (policy version, its weights box, the call, its refs)
        self.pending: dict[int, tuple[int, list[Any] | None, Callable[[Any], Any], dict[int, Any]]] = {}
        self.resume_launch: dict[int, tuple[int, list[Any] | None]] = {}  # restored: step -> version, weights
        self.actors: dict[str, dict[str, Any]] = {}
        self.restarts = self.restarts_this_step = 0

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
            cfg_dict = cfg.model_dump(mode="json")
            # the base weights travel through the object store: no node but the driver's needs the cache. Kept
            # referenced for the run: a restarted worker is built from it again (Ray cannot restart an actor
            # whose constructor arguments went out of scope)
            self.base_weights = base_weights = ray.put(load_file(str(self.base_model)))
            # the actors' processes start now and come up while the reward app deploys
            self.learner = LearnerGroup(cfg, base_weights, self.run_dir)
            n = cfg.ray.rollout_workers
            self.rollout_placement = reserve_bundles(n, cfg.ray.actor_cpus, cfg.ray.rollout_gpus,
                                                     cfg.ray.rollout_placement, "steadyrl-rollout",
                                                     cfg.ray.placement_timeout_s)
            # Ray restarts a dead worker in its bundle (from the base weights); each call names the weights it needs
            self.workers = [
                RolloutWorker.options(
                    num_cpus=cfg.ray.actor_cpus, num_gpus=cfg.ray.rollout_gpus, max_restarts=-1, max_task_retries=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.rollout_placement,
                                                                         placement_group_bundle_index=i),
                ).remote(cfg_dict, base_weights, i, n, str(self.run_dir))
                for i in range(n)
            ]
            # an app already serving this very ensemble (a RayService's, an earlier run's) is used and left up
            self._deployed_app = deploy_reward_app(self.testbed.reward_spec(), cfg.serve, reuse=True)
            # wait until every actor is up (surfaces init errors here, not at the first step)
            infos = ray.get([*self.learner.ready(), *[w.ready.remote() for w in self.workers]])
            self.actors = {f"{a['role']}_{a['index']}": a for a in infos}
            if cfg.ray.weight_sync == "collective":
                self.form_weight_group()
            self._write_actors()
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
        if hasattr(self, "rollout_placement"):
            remove_placement_group(self.rollout_placement)
        if hasattr(self, "learner"):
            self.learner.kill()
        if self._started_serve:  # Serve is detached: on a shared cluster it would outlive the job
            serve.shutdown()
        elif self._deployed_app and APP_NAME in serve.status().applications:
            serve.delete(APP_NAME)
        if self._ray_mode == "joined":
            ray.shutdown()

    # ---------------------------------------------------------------- rollout workers that may die
    def _write_actors(self) -> None:
        """actors.json: each actor's node and pid, and the restarts so far (what to look at, or kill, when
        debugging a run)."""
        write_text_atomically(self.run_dir / ACTORS_FILE, json.dumps(
            {"actors": self.actors, "rollout_restarts": self.restarts}, indent=1))

    def _revive(self, i: int, err: BaseException) -> None:
        """Worker i died (or hung past ray.step_timeout_s: killed here); wait for Ray to restart it (from the base
        weights). A worker still alive in the same process did not fail: the error is re-raised."""
        timeout = self.cfg.ray.step_timeout_s
        if isinstance(err, GetTimeoutError):
            ray.kill(self.workers[i], no_restart=False)
        deadline = time.monotonic() + timeout
        while True:  # calls fail with ActorUnavailableError while Ray restarts the actor
            try:
                info = ray.get(self.workers[i].ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                break
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        if info["pid"] == self.actors[f"rollout_{i}"]["pid"]:  # the same process: it never died
            if isinstance(err, ActorUnavailableError):
                return  # a transient unreachability: re-issue the call
            raise err  # e.g. the learner died and its weights, an argument of the call, with it
        self.restarts += 1
        self.restarts_this_step += 1
        self.actors[f"rollout_{i}"] = info
        self._write_actors()  # every call names its policy version: the re-issued one loads it
        if self.cfg.ray.weight_sync == "collective":  # a new process: a new group, and the current weights to it
            self.form_weight_group()
            if self.version > 0:
                self.broadcast_weights(self.version)

    def issue(self, call: Callable[[Any], Any], indices: list[int] | None = None) -> dict[int, Any]:
        """`call(worker)` on each worker (indices: all); returns its refs (an ObjectRef, or a tuple of them)."""
        return {i: call(self.workers[i]) for i in (range(len(self.workers)) if indices is None else indices)}

    def collect(self, refs: dict[int, Any], call: Callable[[Any], Any]) -> list[tuple[Any, Any]]:
        """Wait for each issued call (a tuple's last ref); a call whose worker died (or hung past
        ray.step_timeout_s) is re-issued on the restarted worker, up to ray.max_rollout_retries times. Returns
        (refs, value of the waited-on ref) per worker. Each call names the policy version it needs, and seeded
        sampling redraws a re-issued step's samples exactly: none is lost or duplicated."""
        retries, timeout = self.cfg.ray.max_rollout_retries, self.cfg.ray.step_timeout_s
        out = []
        for i, issued in refs.items():
            for attempt in range(retries + 1):
                waited = issued[-1] if isinstance(issued, (tuple, list)) else issued
                try:
                    value = ray.get(waited, timeout=timeout)
                    break
                except (RayActorError, GetTimeoutError) as err:
                    if attempt == retries:
                        raise RunFailed(f"rollout worker {i} failed {retries + 1} times in a row ({first_line(err)}; "
                                        "ray.max_rollout_retries)" + self._resume_hint()) from None
                    self.console.print(f"[yellow]rollout worker {i} failed ({type(err).__name__}); restarting it "
                                       f"and re-issuing its call ({attempt + 1}/{retries})", soft_wrap=True)
                    self._revive(i, err)
                    issued = call(self.workers[i])
            out.append((issued, value))
        return out

    def on_workers(self, call: Callable[[Any], Any], indices: list[int] | None = None) -> list[tuple[Any, Any]]:
        """`issue` then `collect`."""
        return self.collect(self.issue(call, indices), call)

    def _resume_hint(self) -> str:
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return "; no checkpoint was written yet"
        return (f"; the last checkpoint, {ckpt}, is intact: resume with "
                f"`steadyrl train --resume {self.run_dir}`")

    # ---------------------------------------------------------------- pieces of a step
    def weights_box(self) -> list[Any] | None:
        """The current policy's weights as a worker call takes them ([ObjectRef]; None: the base weights)."""
        return None if self._weights is None else [self._weights]

    def sync_weights(self) -> float:
        """Publish the learner's weights as policy `self.version`; returns the slowest worker's seconds to fetch
        (or receive) and load them. Under pipelining the workers load them after the generation under way."""
        version = self.version
        if self.cfg.ray.weight_sync == "collective":
            return self.broadcast_weights(version)
        self._weights = self.learner.weights()  # an ObjectRef: the driver never fetches the tensors
        box = self.weights_box()
        return max(seconds for _, seconds in self.on_workers(lambda w: w.set_weights.remote(version, box)))

    def form_weight_group(self) -> None:
        """(Re)build the broadcast group: learner rank 0 is member 0, worker i member i+1, rendezvous at rank 0's
        node. NCCL when the learner and the workers are on GPUs, else gloo."""
        ray_cfg = self.cfg.ray
        backend = "nccl" if ray_cfg.learner_gpus > 0 and ray_cfg.rollout_gpus > 0 else "gloo"
        addr, port = ray.get(self.learner.actors[0].rendezvous.remote())
        size = 1 + len(self.workers)
        get_all([self.learner.actors[0].join_weight_group.remote(addr, port, size, backend),
                 *[w.join_weight_group.remote(addr, port, size, backend) for w in self.workers]],
                ray_cfg.step_timeout_s)

    def broadcast_weights(self, version: int) -> float:
        """One collective broadcast from learner rank 0 to every worker (`ray.weight_sync: collective`)."""
        sources = self.learner.broadcast_weights()
        sinks = [w.receive_weights.remote(version) for w in self.workers]
        done = get_all([*sources, *sinks], self.cfg.ray.step_timeout_s)
        return max(done[len(sources):])

    def launch(self, step: int) -> None:
        """Start every worker's rollout of `step` with the current policy (after a resume: the policy the
        interrupted run had launched it with); `collect` waits for it."""
        version, box = self.resume_launch.pop(step, (self.version, self.weights_box()))
        call = lambda w: w.generate.remote(step, version, box)  # noqa: E731 - re-issued as it is after a restart
        self.pending[step] = (version, box, call, self.issue(call))

    def evaluate(self, step: int) -> dict[str, Any]:
        version, box = self.version, self.weights_box()
        result = self.on_workers(lambda w: w.evaluate.remote(self.cfg.run.eval_seed, version, box), [0])[0][1]
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
        # rollouts already under way (pipelining) sampled with older weights: keep those, so a resume redraws them
        launched = {j: version for j, (version, _, _, _) in self.pending.items()}
        older = {version: box for version, box, _, _ in self.pending.values() if version not in (0, self.version)}
        ray.get([write_weights.remote(box, str(tmp / f"rollout_policy_v{v}.safetensors")) for v, box in older.items()])
        (tmp / "controller.json").write_text(json.dumps({"step": step, "evals": len(self.evals), "version": self.version,
                                                         "pending": {str(j): v for j, v in launched.items()}}))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        write_text_atomically(root / "latest", final.name)
        return final

    def restore(self) -> int:
        ckpt, state = latest_state(self.run_dir)
        self.learner.load(str(ckpt))
        evals_path = self.run_dir / "evals.json"
        self.evals = json.loads(evals_path.read_text())[: state["evals"]] if evals_path.exists() else []
        self.version = int(state.get("version", state["step"]))
        self.sync_weights()
        for j, version in state.get("pending", {}).items():  # relaunch the in-flight rollouts as they were
            box = (None if version == 0 else self.weights_box() if version == self.version
                   else [ray.put(load_file(str(ckpt / f"rollout_policy_v{version}.safetensors")))])
            self.resume_launch[int(j)] = (int(version), box)
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
                next_launch = start
                for step in range(start, cfg.run.steps):
                    t0 = time.perf_counter()
                    self.restarts_this_step = 0
                    # pipelining (learner.max_staleness = s): rollouts of steps up to step + s start now, with the
                    # current weights, and run while the learner trains; s = 0 is the synchronous loop
                    while next_launch < cfg.run.steps and next_launch <= step + cfg.learner.max_staleness:
                        self.launch(next_launch)
                        next_launch += 1
                    _, _, call, issued = self.pending.pop(step)
                    outs = self.collect(issued, call)
                    batch_refs = [refs[0] for refs, _ in outs]
                    summaries = [summary for _, summary in outs]
                    metrics = get_all(self.learner.update(*batch_refs), cfg.ray.step_timeout_s)[0]  # rank 0's
                    self.version += 1
                    metrics["timing_s/sync"] = self.sync_weights()
                    metrics.update(merge_summaries(summaries))
                    metrics["faults/rollout_restarts"] = float(self.restarts_this_step)
                    metrics["timing_s/step"] = time.perf_counter() - t0
                    metrics["rollout/samples"] = metrics.pop("n")
                    metrics["perf/samples_per_s"] = metrics["rollout/samples"] / metrics["timing_s/step"]
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
        except (RayActorError, GetTimeoutError) as err:  # the learner died or hung (workers: see on_workers)
            raise RunFailed(f"the learner died during step {steps_done + 1} ({first_line(err)}); nothing after "
                            f"step {steps_done} was kept" + self._resume_hint()) from None
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


def get_all(refs: list[ray.ObjectRef], timeout_s: float) -> list[Any]:
    """ray.get of every ref, raising the first failure as soon as it is known: when one learner rank dies, the
    others wait in a collective and would never return."""
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise GetTimeoutError(f"no result within {timeout_s:.0f} s (ray.step_timeout_s)")
        ray.get(ready)
    return ray.get(refs)


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


def latest_state(run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The latest checkpoint's folder and its controller state (step, evaluations, pending rollouts)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint to resume from in {Path(run_dir) / CHECKPOINTS}")
    return ckpt, json.loads((ckpt / "controller.json").read_text())


def train(config: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
          resume_dir: str | Path | None = None, console: Console | None = None,
          allow_changes: bool = False) -> RunResult:
    """Entry point shared by the CLI and `python -m steadyrl.services.job`. A resume checks the overrides
    against the run's config (`services.resume`), records them and keeps config.yaml the run's current one."""
    if resume_dir is not None:
        run_dir = Path(resume_dir)
        saved = load_config(run_dir / "config.yaml")
        cfg = load_config(run_dir / "config.yaml", overrides)
        step = int(latest_state(run_dir)[1]["step"])
        changes = check_resume(saved, cfg, step, allow_changes)
        record_resume(run_dir, step, changes)
        if changes:
            write_text_atomically(run_dir / "config.yaml", dump_config(cfg))
        return Controller(cfg, run_dir, console, resume=True).run()
    cfg = load_config(config, overrides)
    return Controller(cfg, new_run_dir(cfg), console).run()
