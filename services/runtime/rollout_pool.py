"""The rollout workers as one pool: their placement group, publishing weights to them (object store or a
collective broadcast), launching and collecting a step's rollouts, and reviving a worker that died.

Each launch names the policy version it samples with and keeps that version's weights, so a call re-issued on
a restarted worker, or relaunched after a resume, samples with exactly the weights it was launched with.
Batches stay in the object store: the pool hands the controller their ObjectRefs and small summaries only.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError
from ray.util.placement_group import remove_placement_group
from rich.console import Console
from safetensors.torch import load_file

from steadyrl.rollout.cache import write_text_atomically
from steadyrl.services.config import TrainConfig
from steadyrl.services.run_folder.checkpoints import ACTORS_FILE, rollout_weights_file
from steadyrl.services.runtime.actors import RolloutWorker, write_weights
from steadyrl.services.runtime.driver_bytes import DRIVER_FETCHES
from steadyrl.services.runtime.learner_group import LearnerGroup
from steadyrl.services.runtime.placement import place_actors
from steadyrl.services.runtime.remote import ACTOR_FAILURES, ComponentFailed, get_all
from steadyrl.services.runtime.retry import first_line



@dataclass(frozen=True)
class PolicyWeights:
    """Policy `version` and the ObjectRef of its trained tensors (None: the base weights every worker holds)."""

    version: int
    ref: ray.ObjectRef | None = None

    def boxed(self) -> list[ray.ObjectRef] | None:
        """The ref inside a list: Ray passes it to the worker unfetched (a worker holding it already skips it)."""
        return None if self.ref is None else [self.ref]


@dataclass
class Launch:
    """A step's rollouts under way: the weights they sample with and each worker's (batch, summary) refs."""

    step: int
    weights: PolicyWeights
    refs: dict[int, tuple[ray.ObjectRef, ray.ObjectRef]]


class RolloutPool:
    """`ray.rollout_workers` RolloutWorker actors in a placement group of their own."""

    def __init__(self, cfg: TrainConfig, base_weights: ray.ObjectRef, run_dir: Path, learner: LearnerGroup,
                 console: Console):
        """`base_weights` stays referenced for the run: Ray rebuilds a dead worker from it."""
        self.cfg, self.run_dir, self.learner, self.console = cfg, Path(run_dir), learner, console
        self.base_weights = base_weights
        n = cfg.ray.rollout_workers
        cfg_dict = cfg.model_dump(mode="json")
        self.placement, self.workers = place_actors(
            RolloutWorker, n, cfg.ray.actor_cpus, cfg.ray.rollout_gpus, cfg.ray.rollout_placement, "steadyrl-rollout",
            cfg.ray.placement_timeout_s, lambda i: (cfg_dict, base_weights, i, n, str(self.run_dir)),
            cfg.ray.roles.rollout, max_restarts=-1, max_task_retries=0)
        self.current = PolicyWeights(0)  # the weights last published
        self.launches: dict[int, Launch] = {}  # step -> rollouts launched and not yet collected
        self.infos: dict[str, dict[str, Any]] = {}  # actor name -> where it runs (actors.json)
        self.restarts = self.restarts_this_step = 0

    # ------------------------------------------------------------------ start / stop
    def start(self, learner_infos: list[dict[str, Any]]) -> None:
        """Wait until every worker is up (init errors surface here), form the broadcast group if one is used,
        and write actors.json."""
        infos = get_all([(f"rollout worker {i}", w.ready.remote()) for i, w in enumerate(self.workers)],
                        self.cfg.ray.step_timeout_s)
        self.infos = {f"{a['role']}_{a['index']}": a for a in [*learner_infos, *infos]}
        if self.cfg.ray.weight_sync == "collective":
            self._form_weight_group()
        self._write_actors()

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self.placement)

    def _write_actors(self) -> None:
        """actors.json: each actor's node and pid, and the restarts so far (what to look at, or kill, when
        debugging a run)."""
        write_text_atomically(self.run_dir / ACTORS_FILE, json.dumps(
            {"actors": self.infos, "rollout_restarts": self.restarts}, indent=1))

    # ------------------------------------------------------------------ weights
    def publish(self, version: int) -> float:
        """Make the learner's weights to sample with (`Learner.sampling_weights`) policy `version` on every
        worker; returns the slowest worker's seconds to fetch (or receive) and load them. Under pipelining a worker
        loads them after the generation under way."""
        if self.cfg.ray.weight_sync == "collective":
            self.current = PolicyWeights(version)
            return self._broadcast(version)
        # a ref: the driver never fetches tensors
        self.current = PolicyWeights(version, self.learner.sampling_weights())
        box = self.current.boxed()
        seconds = max(self._on_workers(lambda w: w.set_weights.remote(version, box)))
        if self.current.ref is not None:
            DRIVER_FETCHES.weights_ref(self.current.ref, self._nodes("learner"), self._nodes("rollout"))
        return seconds

    def _nodes(self, role: str) -> set[str]:
        """The Ray node ids the role's actors run on (actors.json's, kept as workers restart)."""
        return {info["node_id"] for info in self.infos.values() if info["role"] == role}

    def _form_weight_group(self) -> None:
        """(Re)build the broadcast group: learner rank 0 is member 0, worker i member i+1, rendezvous at rank 0's
        node. NCCL when the learner and the workers are on GPUs, else gloo."""
        ray_cfg = self.cfg.ray
        backend = "nccl" if ray_cfg.learner_gpus > 0 and ray_cfg.rollout_gpus > 0 else "gloo"
        addr, port = get_all([("the learner", self.learner.actors[0].rendezvous.remote())], ray_cfg.step_timeout_s)[0]
        size = 1 + len(self.workers)
        get_all([("the learner", self.learner.actors[0].join_weight_group.remote(addr, port, size, backend)),
                 *[(f"rollout worker {i}", w.join_weight_group.remote(addr, port, size, backend))
                   for i, w in enumerate(self.workers)]], ray_cfg.step_timeout_s)

    def _broadcast(self, version: int) -> float:
        """One collective broadcast from learner rank 0 to every worker (`ray.weight_sync: collective`)."""
        sources = [("the learner", ref) for ref in self.learner.broadcast_weights()]
        sinks = [(f"rollout worker {i}", w.receive_weights.remote(version)) for i, w in enumerate(self.workers)]
        return max(get_all([*sources, *sinks], self.cfg.ray.step_timeout_s)[len(sources):])

    # ------------------------------------------------------------------ rollouts
    def launch(self, step: int, weights: PolicyWeights | None = None) -> None:
        """Start every worker's rollout of `step` with `weights` (default: the weights last published)."""
        weights = weights or self.current
        self.launches[step] = Launch(step, weights, self._issue(self._generate_call(step, weights)))

    def collect(self, step: int) -> tuple[list[ray.ObjectRef], list[dict[str, float]]]:
        """Wait for `step`'s rollouts: (each worker's batch ref, each worker's summary). The batches' sizes are
        counted, and any that Ray returned inline to the driver (`driver_bytes`)."""
        launch = self.launches.pop(step)
        outs = self._collect(launch.refs, self._generate_call(step, launch.weights))
        batches = [refs[0] for refs, _ in outs]
        DRIVER_FETCHES.batch_refs(batches, self._nodes("learner"))
        return batches, [summary for _, summary in outs]

    @staticmethod
    def _generate_call(step: int, weights: PolicyWeights) -> Callable[[Any], Any]:
        box = weights.boxed()
        return lambda w: w.generate.remote(step, weights.version, box)

    def evaluate(self, seed: int) -> dict[str, Any]:
        """Worker 0's held-out evaluation with the weights last published."""
        version, box = self.current.version, self.current.boxed()
        return self._on_workers(lambda w: w.evaluate.remote(seed, version, box), [0])[0]

    def begin_step(self) -> None:
        self.restarts_this_step = 0

    # ------------------------------------------------------------------ checkpoint / resume
    def in_flight(self) -> dict[int, int]:
        """step -> policy version of the rollouts launched and not yet collected (pipelining)."""
        return {step: launch.weights.version for step, launch in self.launches.items()}

    def save_in_flight(self, directory: Path) -> None:
        """The weights of in-flight rollouts launched with an older policy than the learner's (pipelining), so a
        resume relaunches them as they were."""
        older = {launch.weights.version: launch.weights for launch in self.launches.values()
                 if launch.weights.version not in (0, self.current.version)}
        ray.get([write_weights.remote(w.boxed(), str(directory / rollout_weights_file(v))) for v, w in older.items()])

    def discard_in_flight(self) -> None:
        """Forget the rollouts launched and not collected (a rollback: they were sampled by abandoned weights); the
        workers finish them and their results are dropped with the refs."""
        self.launches.clear()

    def relaunch(self, in_flight: dict[str, int], directory: Path) -> None:
        """Launch again the rollouts a checkpoint recorded as in flight, each with the policy it had."""
        for step, version in in_flight.items():
            weights = (PolicyWeights(0) if version == 0 else self.current if version == self.current.version
                       else PolicyWeights(version, ray.put(load_file(str(directory / rollout_weights_file(version))))))
            self.launch(int(step), weights)

    # ------------------------------------------------------------------ workers that may die
    def _issue(self, call: Callable[[Any], Any], indices: list[int] | None = None) -> dict[int, Any]:
        """`call(worker)` on each worker (indices: all); returns its refs (an ObjectRef, or a tuple of them)."""
        return {i: call(self.workers[i]) for i in (range(len(self.workers)) if indices is None else indices)}

    def _on_workers(self, call: Callable[[Any], Any], indices: list[int] | None = None) -> list[Any]:
        """`call` on the workers, waited for (with revival): each worker's value."""
        return [value for _, value in self._collect(self._issue(call, indices), call)]

    def _collect(self, refs: dict[int, Any], call: Callable[[Any], Any]) -> list[tuple[Any, Any]]:
        """Wait for each issued call (a tuple's last ref); a call whose worker died (or hung past
        ray.step_timeout_s) is re-issued on the restarted worker, up to ray.max_rollout_retries times. Returns
        (refs, value of the waited-on ref) per worker. Seeded sampling redraws a re-issued step's samples
        exactly: none is lost or duplicated."""
        retries, timeout = self.cfg.ray.max_rollout_retries, self.cfg.ray.step_timeout_s
        out = []
        for i, issued in refs.items():
            for attempt in range(retries + 1):
                waited = issued[-1] if isinstance(issued, (tuple, list)) else issued
                try:
                    value = DRIVER_FETCHES.fetched(ray.get(waited, timeout=timeout))
                    break
                except ACTOR_FAILURES as err:
                    if attempt == retries:
                        raise ComponentFailed(f"rollout worker {i}", f"failed {retries + 1} times in a row",
                                              f"{first_line(err)}; ray.max_rollout_retries") from None
                    self.console.print(f"[yellow]rollout worker {i} failed ({type(err).__name__}); restarting it "
                                       f"and re-issuing its call ({attempt + 1}/{retries})", soft_wrap=True)
                    self._revive(i, err)
                    issued = call(self.workers[i])
            out.append((issued, value))
        return out

    def _revive(self, i: int, err: BaseException) -> None:
        """Worker i died (or hung past ray.step_timeout_s: killed here); wait for Ray to restart it (from the base
        weights). A worker still alive in the same process did not fail: the error is re-raised."""
        timeout = self.cfg.ray.step_timeout_s
        if isinstance(err, GetTimeoutError):
            ray.kill(self.workers[i], no_restart=False)
        deadline = time.monotonic() + timeout
        while True:  # calls fail with ActorUnavailableError while Ray restarts the actor
            try:
                info = DRIVER_FETCHES.fetched(ray.get(self.workers[i].ready.remote(),
                                                      timeout=max(1.0, deadline - time.monotonic())))
                break
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        if info["pid"] == self.infos[f"rollout_{i}"]["pid"]:  # the same process: it never died
            if isinstance(err, ActorUnavailableError):
                return  # a transient unreachability: re-issue the call
            # e.g. the learner died and its weights, an argument of the call, with it
            raise ComponentFailed(f"rollout worker {i}", "failed", f"{first_line(err)}; the worker itself is alive")
        self.restarts += 1
        self.restarts_this_step += 1
        self.infos[f"rollout_{i}"] = info
        self._write_actors()  # every call names its policy version: the re-issued one loads it
        if self.cfg.ray.weight_sync == "collective":  # a new process: a new group, and the current weights to it
            self._form_weight_group()
            if self.current.version > 0:
                self._broadcast(self.current.version)

