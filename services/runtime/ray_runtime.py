"""The Ray runtime: a local or joined Ray, the Serve reward ensemble, the learner group and the rollout pool.

What the controller's loop runs over by default; `services.runtime.local_runtime.LocalRuntime` is its one-process twin.
"""
from __future__ import annotations

import json
from pathlib import Path

import ray
from ray import serve
from rich.console import Console
from safetensors.torch import load_file

from steadyrl.rollout.cache import write_text_atomically
from steadyrl.services.config import TrainConfig
from steadyrl.services.runtime.learner_group import LearnerGroup
from steadyrl.services.runtime.node_fit import check_roles_fit, reward_demand, training_demands
from steadyrl.services.runtime.ray_session import init_ray, start_serve
from steadyrl.services.runtime.rollout_pool import RolloutPool
from steadyrl.services.serving import APP_NAME, ROUTE_PREFIX, deploy_reward_app
from steadyrl.services.testbeds.base import Testbed


class RayRuntime:
    """Starts (or joins) Ray and Serve, deploys the testbed's reward app (or reuses the one already serving
    its very ensemble), and starts the learner group and the rollout pool; `shutdown` stops what it started."""

    name = "ray"

    def __init__(self, cfg: TrainConfig, testbed: Testbed, run_dir: Path, console: Console):
        self.cfg, self.testbed, self.run_dir, self.console = cfg, testbed, Path(run_dir), console
        self._ray_mode = "existing"
        self._started_serve = False
        self._deployed_app = False  # this run deployed the reward app (not found already serving its ensemble)

    def start(self, base_model: Path) -> tuple[RolloutPool, LearnerGroup]:
        cfg = self.cfg
        cfg.serve.token_sha256()  # read the REST token (if any) and drop its variable before Ray's processes start
        with self.console.status("starting Ray, the Serve reward ensemble and the DeepSpeed learner"):
            self._ray_mode = init_ray(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.local_network, cfg.ray.worker_niceness)
            if cfg.ray.check_nodes:
                check_roles_fit([*training_demands(cfg), reward_demand(cfg, self.testbed)])
            # the base weights travel through the object store: no node but the driver's needs the cache
            base_weights = ray.put(load_file(str(base_model)))
            # the actors' processes start now, the learner builds its engine, and both go on while Serve starts
            # and the reward app deploys
            self.learner = LearnerGroup(cfg, base_weights, self.run_dir)
            self.pool = RolloutPool(cfg, base_weights, self.run_dir, self.learner, self.console)
            self.learner.start()
            self._started_serve, port = start_serve(cfg.serve, self.run_dir / "logs" / "serve")
            # an app already serving this very ensemble (a RayService's, an earlier run's) is used and left up
            self._deployed_app = deploy_reward_app(self.testbed, cfg.serve, reuse=True, placement=cfg.ray.roles.reward)
            self.pool.start(self.learner.infos())
        reward_url = f"http://{cfg.serve.host}:{port}{ROUTE_PREFIX}"
        write_text_atomically(self.run_dir / "endpoints.json", json.dumps({"reward": reward_url}))
        if cfg.run.progress:
            self.console.print(f"reward ensemble: {reward_url}/docs   run folder: {self.run_dir}   "
                               f"logs: {self.run_dir / 'logs'}")
        return self.pool, self.learner

    def shutdown(self) -> None:
        """Stop what this run started; a Ray or Serve that was already running is left up."""
        if not ray.is_initialized():
            return
        if self._ray_mode == "local":
            ray.shutdown()  # the whole local Ray goes, Serve and every actor with it
            return
        if hasattr(self, "pool"):
            self.pool.shutdown()
        if hasattr(self, "learner"):
            self.learner.kill()
        if self._started_serve:  # Serve is detached: on a shared cluster it would outlive the job
            serve.shutdown()
        elif self._deployed_app and APP_NAME in serve.status().applications:
            serve.delete(APP_NAME)
        if self._ray_mode == "joined":
            ray.shutdown()
