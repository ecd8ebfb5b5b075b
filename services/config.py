"""The whole run's config: YAML presets validated by pydantic, with `key.sub=value` overrides."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from steadyrl.rollout.compile import CompileConfig
from steadyrl.rollout.config import DEFAULT_SAMPLER_KIND, DDIMSamplerConfig, SamplerConfig
from steadyrl.rollout.plugins import check_plugins
from steadyrl.rollout.settings_base import ConfigError, StrictModel  # noqa: F401 - ConfigError: raised here
from steadyrl.services.testbeds.registry import DEFAULT_TESTBED, TESTBED_SETTINGS
from steadyrl.trainer.anomaly import AnomalyConfig
from steadyrl.trainer.collapse import RollbackConfig
from steadyrl.trainer.config import DEFAULT_OBJECTIVE, LearnerConfig, ObjectiveConfig
from steadyrl.trainer.linear_schedule import fill_total_updates
from steadyrl.trainer.objectives import objective_class
from steadyrl.trainer.update_path import update_path
from steadyrl.trainer.objectives.grpo import GRPOSettings

# the checkout's configs/ (editable install), else ./configs (a plain install run from the repo, as in the image)
CONFIG_DIR = next((d for d in (Path(__file__).resolve().parent.parent / "configs", Path.cwd() / "configs")
                   if d.is_dir()), Path("configs"))
DEFAULT_CONFIG = CONFIG_DIR / "digits-grpo.yaml"


class ServeConfig(StrictModel):
    """The reward ensemble's Serve application: where its HTTP proxy listens, what its replicas reserve, how
    they batch, and the limits of its REST API (services/serving/)."""

    host: str = Field("127.0.0.1", description="address Serve's HTTP proxy binds: loopback, so the REST API is "
                      "not reachable from the network unless asked for (0.0.0.0 in a cluster pod)")
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port")
    replica_cpus: float = Field(0.1, gt=0, le=0.25, description="CPUs per reward replica")
    replica_gpus: float = Field(0.25, ge=0, le=1, description="GPU share Ray reserves for each reward replica "
                                "whose model runs on cuda (`device: cuda`); CPU models reserve none")
    batching: bool = Field(True, description="group concurrent calls to one reward model into one forward pass "
                           "(`@serve.batch`): fewer, larger passes under load; off: each call is scored on its own "
                           "(benchmarks/reward_load.py compares the two)")
    colocate_models: bool = Field(False, description="host every reward model in the ensemble's own replica, "
                                  "called in-process, instead of one replica per model: one process instead of one "
                                  "plus one per model (the digits job: 5). On a small machine each resident process "
                                  "takes memory and CPU from the run (benchmarks/colocated_rewards.py); the models "
                                  "then share that replica's CPUs (or GPU share) and are not batched across callers")
    max_batch_size: int = Field(256, ge=1, description="most calls `@serve.batch` groups into one forward pass")
    batch_wait_timeout_s: float = Field(0.005, ge=0, description="how long a batch waits for more calls: "
                                        "latency traded for larger batches")
    max_ongoing_requests: int = Field(32, ge=1, description="calls one replica works on at once; a batch can "
                                      "only group calls in flight together (Serve's default, 5, caps it at 5)")
    max_request_samples: int = Field(256, ge=1, description="samples per REST request; more get a 422 naming "
                                     "`samples`: bounds one request's latency and memory, so one client's request cannot "
                                     "hold a replica for long. "
                                     "The in-cluster handle training uses is not limited")
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="largest REST request body; larger get a 413 "
                                "before any JSON is parsed (a JSON body is decoded whole in memory)")
    request_timeout_s: float = Field(120, gt=0, description="most one scoring call from a rollout worker may "
                                     "take before it is retried (a replica that died or hangs)")
    max_retries: int = Field(5, ge=0, description="times a rollout worker retries a failed scoring call (a reward "
                             "replica killed mid-call: Serve starts a new one meanwhile); past it the step fails")
    retry_backoff_s: float = Field(1.0, ge=0, description="wait before the first retry, doubled for each next one "
                                   "(capped at 8x): time for Serve to replace a replica")
    body_timeout_s: float = Field(30, gt=0, description="most time a REST request body may take to arrive in "
                                  "full; 408 after: a client trickling its body cannot hold a working slot longer")
    body_idle_timeout_s: float = Field(5, gt=0, description="most time between two pieces of a REST request body; "
                                       "408 after: a client that stalls mid-upload is dropped")
    max_unfinished_bodies: int | None = Field(None, ge=1, description="REST request bodies one ingress replica "
                                              "reads at once (None: half of max_ongoing_requests). When all are "
                                              "taken, a new upload takes the slot of the one that has sent nothing "
                                              "for the longest (that one gets a 408). Below max_ongoing_requests, "
                                              "so stalled uploads never hold every working slot and never keep a "
                                              "new upload out: /healthz and other callers keep being served")
    auth_token_env: str | None = Field(None, description="name of an environment variable holding a bearer "
                                       "token; then every REST route but /healthz and the docs needs "
                                       "`Authorization: Bearer <token>` (401 otherwise). Read once, before Ray "
                                       "starts, and then removed from the environment: no Ray process inherits it; "
                                       "only its SHA-256 reaches the replicas, and nothing logs it")
    auth_token_file: str | None = Field(None, description="a file holding the bearer token (e.g. a mounted "
                                        "Kubernetes secret): the alternative to auth_token_env")
    _token_sha256: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_token_source(self) -> "ServeConfig":
        if self.auth_token_env and self.auth_token_file:
            raise ValueError("set serve.auth_token_env or serve.auth_token_file, not both")
        return self

    @model_validator(mode="after")
    def _uploads_leave_working_slots(self) -> "ServeConfig":
        if self.max_unfinished_bodies is not None and self.max_unfinished_bodies >= self.max_ongoing_requests:
            raise ValueError(f"serve.max_unfinished_bodies ({self.max_unfinished_bodies}) must be below "
                             f"serve.max_ongoing_requests ({self.max_ongoing_requests}): slow uploads would take "
                             "every working slot of a replica")
        return self

    def upload_slots(self) -> int:
        """Request bodies read at once per ingress replica: `max_unfinished_bodies`, or half the working slots."""
        return self.max_unfinished_bodies or max(1, self.max_ongoing_requests // 2)

    def token_sha256(self) -> str | None:
        """SHA-256 hex of the bearer token the REST API requires (None: no auth), read once and kept on this
        config. A token from `auth_token_env` is then removed from this process's environment, so no process
        started after it (Ray's, the replicas) inherits it: call this before Ray starts. A named source that is
        unset or empty is an error, so a typo never silently turns auth off."""
        import os

        if self._token_sha256 is not None or not (self.auth_token_env or self.auth_token_file):
            return self._token_sha256
        if self.auth_token_env:
            token = os.environ.pop(self.auth_token_env, "").strip()
            if not token:
                raise ValueError(f"serve.auth_token_env={self.auth_token_env!r}: that environment variable is "
                                 "unset or empty")
        else:
            path = Path(self.auth_token_file).expanduser()
            try:
                token = path.read_text().strip()
            except OSError as err:
                raise ValueError(f"serve.auth_token_file={str(path)!r}: cannot read it ({err.strerror})") from None
            if not token:
                raise ValueError(f"serve.auth_token_file={str(path)!r} is empty")
        self._token_sha256 = token_digest(token)
        return self._token_sha256


def token_digest(token: str) -> str:
    """SHA-256 hex of a bearer token: what the replicas hold and compare against."""
    return hashlib.sha256(token.encode()).hexdigest()


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RolePlacement(StrictModel):
    """The nodes one role's actors may run on, in a cluster whose nodes are told apart by labels or resources."""

    labels: dict[str, str] = Field(
        default_factory=dict, description="node labels each of the role's actors needs on its node (Ray's label "
        "selector: nodes started with `ray start --labels`, a KubeRay worker group's rayStartParams), e.g. "
        "{steadyrl.io/role: rollout}; empty: any node")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom resources each of the role's actors asks for besides its CPUs "
        "and GPUs (nodes started with `ray start --resources`), e.g. {rollout_node: 0.01}: only nodes that "
        "declare them host the role, and their amount caps how many actors fit")

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        builtin = sorted(set(resources) & set(RAY_BUILTIN_RESOURCES))
        if builtin:
            raise ValueError(f"{builtin} are Ray's own resources, set by ray.actor_cpus / rollout_gpus / "
                             "learner_gpus / serve.replica_cpus; name custom resources here")
        if any(v <= 0 for v in resources.values()):
            raise ValueError(f"amounts must be > 0, got {resources}")
        return resources

    def bundle(self, cpus: float, gpus: float) -> dict[str, float]:
        """What one of the role's actors asks Ray for: `cpus` CPUs, `gpus` GPUs (when > 0), its custom resources."""
        return {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {}), **self.resources}

    def ray_options(self) -> dict[str, Any]:
        """These as Ray actor options (`resources`, `label_selector`), only those set."""
        return {**({"resources": dict(self.resources)} if self.resources else {}),
                **({"label_selector": dict(self.labels)} if self.labels else {})}


class Roles(StrictModel):
    """Where each role runs on a cluster (`RolePlacement`); unset, Ray places every actor where it fits."""

    rollout: RolePlacement = Field(default_factory=RolePlacement, description="the rollout workers")
    learner: RolePlacement = Field(default_factory=RolePlacement, description="the DeepSpeed learner ranks")
    reward: RolePlacement = Field(default_factory=RolePlacement, description="the Serve reward ensemble's "
                                  "replicas (Serve's controller and HTTP proxy stay on the head node)")


class RayConfig(StrictModel):
    address: str | None = Field(None, description="None: $RAY_ADDRESS or a new local Ray")
    num_cpus: int | None = Field(None, ge=1, description="for a new local Ray; None = all cores")
    local_network: Literal["loopback", "all"] = Field(
        "loopback", description="interfaces a new local Ray listens on (GCS, raylet, object manager, agents, "
        "Prometheus metrics): loopback keeps them to this machine; all (Ray's own default) lets other machines "
        "join it and scrape its metrics, which need no login. A cluster joined through ray.address keeps its own")
    worker_niceness: int = Field(
        0, ge=0, le=19, description="niceness a new local Ray gives its workers (rollout and learner actors, Serve "
        "replicas) on top of its own: Ray's default 15 lets any other CPU job on the machine starve them while the "
        "driver, which only waits on them, keeps its share (benchmarks/worker_niceness.py); 0 runs them at the "
        "driver's priority. A cluster joined through ray.address keeps its own setting (Ray's worker_niceness)")
    rollout_workers: int = Field(1, ge=1, description="each samples its share of the prompts (classes)")
    actor_cpus: float = Field(0.5, gt=0)
    rollout_gpus: float = Field(0, ge=0, description="GPUs each rollout worker asks Ray for; > 0 places its "
                                "policy, noise and VAE on cuda (fractions share a GPU between workers)")
    learner_gpus: float = Field(0, ge=0, description="GPUs the learner asks Ray for; > 0 runs DeepSpeed on cuda "
                                "(NCCL) instead of the CPU (gloo)")
    torch_threads: int | None = Field(None, ge=1, description="torch threads per actor; None = all cores when the "
                                      "phases run one after another, half of them under pipelining "
                                      "(learner.max_staleness > 0: rollout and learner compute at once)")
    keep_freed_memory: bool = Field(
        True, description="glibc malloc in the processes that sample and train (the local runtime's, rollout "
        "workers, learner ranks) keeps freed memory for the next step instead of returning it to the OS, where "
        "each step's large CPU tensors come back as fresh pages the kernel faults in and zeroes. On by default "
        "because that work repeats every step for the same tensors, at the cost of RSS held at its peak "
        "(figures: docs/benchmarks.md). false: glibc's own policy, for a process whose "
        "RSS must shrink between steps (it stays at its peak). No effect on GPU memory or where the C library "
        "is not glibc")
    rollout_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="placement-group strategy of the rollout workers (one bundle each: actor_cpus and "
        "rollout_gpus); SPREAD puts them on different nodes")
    weight_sync: Literal["object_store", "collective"] = Field(
        "object_store", description="how new weights reach the rollout workers: object_store (each fetches the "
        "learner's tensors from Ray's object store; the CPU default) or collective (learner rank 0 broadcasts them "
        "to every worker in a process group of their own: NCCL when learner and workers are on GPUs, else gloo; "
        "nothing passes through the object store). collective needs learner.max_staleness=0")
    learner_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="placement-group strategy of the learner ranks: PACK keeps them on as few nodes as "
        "possible (NCCL within a node is fastest); STRICT_SPREAD puts one rank per node")
    placement_timeout_s: float = Field(600, gt=0, description="how long to wait for a placement group's resources "
                                       "(GPUs, CPUs) before failing with what could not be placed, instead of "
                                       "hanging on a cluster that cannot provide them")
    step_timeout_s: float = Field(1800, gt=0, description="most one rollout call (a step's generation, a weight "
                                  "sync, an evaluation) may take on one worker: past it the worker is taken as hung, "
                                  "killed and restarted, and the call re-issued")
    max_rollout_retries: int = Field(3, ge=0, description="times one call is re-issued after its rollout worker "
                                     "died (Ray restarts the actor; it gets the current weights first, and its "
                                     "seeded sampling redraws the very same samples); past it the run fails")
    check_nodes: bool = Field(True, description="before any actor starts, fail naming the role when no live node "
                              "could ever host it (its labels, custom resources, GPUs, CPUs), instead of waiting "
                              "ray.placement_timeout_s; off for an autoscaling cluster, whose nodes start on demand")
    roles: Roles = Field(default_factory=Roles, description="the nodes each role runs on, by node labels or "
                         "custom resources: rollout workers, learner ranks and reward replicas on nodes of their "
                         "own (docs/architecture.md, 'Across nodes')")


class HealthConfig(StrictModel):
    """The controller's watch over the run (`services.driver.run_health`): reward hacking and collapse."""

    anomaly: AnomalyConfig = Field(default_factory=AnomalyConfig, description="reward-hacking detection and its "
                                   "response: a raised KL weight for some updates, the batch saved, the event counted")
    rollback: RollbackConfig = Field(default_factory=RollbackConfig, description="collapse detection and automatic "
                                     "rollback to the last healthy checkpoint with a lowered learning rate")


class RunConfig(StrictModel):
    steps: int = Field(80, ge=1)
    seed: int = 0
    run_dir: str | None = Field(None, description="None: runs/<name>-<timestamp>")
    max_restarts: int = Field(3, ge=0, description="times the run restarts itself from its last checkpoint when a "
                              "process or node it cannot replace in place is lost (a learner rank's node; a rollout "
                              "worker past ray.max_rollout_retries): the runtime is rebuilt on the nodes left and the "
                              "steps since the checkpoint redone (recoveries.jsonl). 0: stop with the resume hint")
    resume: Literal["never", "auto"] = Field(
        "never", description="auto: a command run again (a RayJob's retry, a person re-running it after the driver "
        "died) continues the run in run.run_dir from its latest checkpoint instead of starting over, refusing a "
        "folder whose config differs beyond resume-safe settings; a folder without a checkpoint starts afresh. "
        "Needs run.run_dir, on storage the next driver sees")
    name: str = "digits-grpo"
    eval_every: int = Field(20, ge=1)
    eval_seed: int = 1234
    target_held_out: float | None = Field(
        None, description="end the run at the first evaluation whose held-out score reaches this (digits: gold "
        "accuracy, arith: exact match), checkpointed there, instead of going on to run.steps: what a user waits "
        "for is a good model, not a number of steps (benchmarks/time_to_target.py). Evaluate often enough to place "
        "the crossing (run.eval_every). None: run all run.steps")
    checkpoint_every: int = Field(20, ge=1)
    progress: bool = True
    runtime: Literal["ray", "local"] = Field(
        "ray", description="ray: rollout actors, the Serve reward ensemble and DeepSpeed ranks (a local Ray or a "
        "cluster); local: the same loop, metrics and checkpoints in one process without Ray or Serve, for "
        "debugging and many-seed benchmarks (`steadyrl train --local`); both compute the same run")
    loggers: list[Literal["mlflow", "wandb"]] = Field(
        default_factory=list, description="experiment trackers that also get each step's metrics and the config, "
        "besides metrics.jsonl and TensorBoard: mlflow (extra `steadyrl[mlflow]`; $MLFLOW_TRACKING_URI, default a "
        "file store in the run folder's mlruns/) and wandb (extra `steadyrl[wandb]`; $WANDB_MODE, default offline "
        "without an API key, files in the run folder's wandb/). A resumed run logs on into the same tracker run")

    @model_validator(mode="after")
    def _auto_resume_has_a_folder(self) -> "RunConfig":
        if self.resume == "auto" and not self.run_dir:
            raise ValueError("resume=auto needs run_dir: the folder a re-run of the same command finds again (on "
                             "storage every driver sees, e.g. a shared volume)")
        return self

    @field_validator("loggers")
    @classmethod
    def _loggers_installed(cls, loggers: list[str]) -> list[str]:
        import importlib.util

        for name in loggers:
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"{name!r} is not installed: pip install 'steadyrl[{name}]' (or drop it from "
                                 "run.loggers)")
        return list(dict.fromkeys(loggers))


TestbedConfig = Annotated[Union[tuple(TESTBED_SETTINGS.values())], Field(discriminator="name")]


class TrainConfig(StrictModel):
    """Everything one training run needs; each default lives in the section's own model."""

    testbed: TestbedConfig = Field(
        default_factory=TESTBED_SETTINGS[DEFAULT_TESTBED], description="the testbed and only its settings, picked "
        "by `name`: digits (a class-conditional UNet, its pre-training and classifier rewards), arith (a "
        "masked-diffusion LM and a verifier; sampler.kind=masked_diffusion), arith_ar (the same tasks for a causal "
        "LM; sampler.kind=autoregressive, backend transformers or vllm), arith_bd (the same tasks for a "
        "block-diffusion LM, DiffusionGemma; sampler.kind=block_diffusion, backend transformers or vllm), "
        "text_to_image (a diffusers pipeline, prompts, image rewards). `testbed: arith` is short for "
        "`testbed: {name: arith}`")
    run: RunConfig = Field(default_factory=RunConfig)
    sampler: SamplerConfig = Field(default_factory=DDIMSamplerConfig)
    objective: ObjectiveConfig = Field(default_factory=GRPOSettings)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    health: HealthConfig = Field(default_factory=HealthConfig, description="the controller's responses to a run "
                                 "going wrong: reward hacking (a raised KL weight) and collapse (a rollback)")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="torch.compile of the model passes: "
                                   "the rollout's denoiser calls and the learner's forward and backward (off: each "
                                   "compile costs start-up time that a short run may not earn back; figures in "
                                   "docs/benchmarks.md)")

    @model_validator(mode="before")
    @classmethod
    def _testbed_by_name(cls, data: Any) -> Any:
        """`testbed: arith` means `{name: arith}`; a section without a name is the default testbed's."""
        if isinstance(data, dict):
            tb = data.get("testbed")
            if isinstance(tb, str):
                data = {**data, "testbed": {"name": tb}}
            elif isinstance(tb, dict) and "name" not in tb:
                data = {**data, "testbed": {"name": DEFAULT_TESTBED, **tb}}
        return data

    @model_validator(mode="after")
    def _testbed_fits(self) -> "TrainConfig":
        tb = self.testbed
        if self.sampler.kind not in tb.sampler_kinds:
            raise ValueError(f"testbed {tb.name!r} needs sampler.kind={' or '.join(tb.sampler_kinds)}, got "
                             f"{self.sampler.kind!r}")
        if self.ray.rollout_workers > tb.max_workers():
            raise ValueError(f"ray.rollout_workers={self.ray.rollout_workers} exceeds the {tb.max_workers()} prompts "
                             f"per step of testbed {tb.name!r}")
        objective = objective_class(self.objective.name)
        if objective.update_path == "reward_backprop" and tb.no_reward_backprop is not None:
            raise ValueError(f"objective.name={self.objective.name!r} back-propagates the training reward, but testbed "
                             f"{tb.name!r} cannot: {tb.no_reward_backprop}")
        update_path(objective, self.objective, self.sampler)  # the check the learner runs when it picks its path
        tb.check(self)
        if self.ray.weight_sync == "collective" and self.learner.max_staleness > 0:
            raise ValueError("ray.weight_sync=collective needs learner.max_staleness=0 (pipelined rollouts re-issued "
                             "after a worker restart need older weights, which only the object store keeps)")
        if self.health.anomaly.enabled and self.objective.reference_kl_coef <= 0:
            raise ValueError(f"health.anomaly answers an event by raising the KL weight, but objective "
                             f"{self.objective.name!r} has no KL term (objective.kl_coef is 0 or absent): set "
                             "objective.kl_coef > 0 or leave health.anomaly.enabled off")
        if self.compile.rollout and getattr(self.sampler, "backend", None) == "vllm":
            raise ValueError("compile.rollout compiles the network the rollout worker samples with, but "
                             "sampler.backend=vllm samples in vLLM's engine: set sampler.vllm.enforce_eager=false "
                             "for vLLM's own compilation and leave compile.rollout off")
        if self.learner.fused_adam and self.ray.learner_gpus <= 0:
            raise ValueError("learner.fused_adam=true runs DeepSpeed's CUDA kernel: it needs the learner on a GPU "
                             "(ray.learner_gpus > 0); on the CPU leave it false (torch's AdamW)")
        if self.run.runtime == "local" and self.learner.ranks != 1:
            raise ValueError(f"learner.ranks={self.learner.ranks}: run.runtime=local runs one learner rank in its "
                             "process; use run.runtime=ray for more")
        return self

    @model_validator(mode="after")
    def _lr_schedule_spans_the_run(self) -> "TrainConfig":
        """An lr or KL schedule without `total_updates` spans the run's steps (written into the saved config, so a
        resumed run keeps it)."""
        schedule = self.learner.lr_schedule
        if schedule.kind == "cosine" and schedule.total_updates is None:
            if schedule.warmup_updates >= self.run.steps:
                raise ValueError(f"learner.lr_schedule.warmup_updates={schedule.warmup_updates} must be less than "
                                 f"run.steps={self.run.steps}")
            schedule.total_updates = self.run.steps
        if self.learner.kl_schedule.kind != "constant" and self.learner.kl_schedule.total_updates is None:
            self.learner.kl_schedule.total_updates = self.run.steps
        fill_total_updates(self.learner, self.run.steps)  # the linear schedules (trainer/linear_schedule.py)
        fill_total_updates(self.objective, self.run.steps)
        refusal = self.objective.zero_partition_refusal()
        if refusal is not None and self.learner.zero_stage > 0:
            raise ValueError(refusal)
        return self


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
        node = nxt
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ('a.b', YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({err})") from err
    return key, value


# Sections whose first key picks a model with its own settings: switching it starts the section afresh
# (a GRPO preset's eps_clip must not leak into an objective without one).
SWITCHES = {"objective": ("name", DEFAULT_OBJECTIVE), "sampler": ("kind", DEFAULT_SAMPLER_KIND),
            "testbed": ("name", DEFAULT_TESTBED)}


def _where(loc: tuple[Any, ...]) -> str:
    """Dotted field path; the tag pydantic puts after a discriminated section (`objective.grpo.x`)
    becomes a note (`objective.x (objective 'grpo')`)."""
    parts = [str(p) for p in loc]
    if len(parts) >= 3 and parts[0] in SWITCHES:
        return ".".join([parts[0]] + parts[2:]) + f" ({parts[0]} {parts[1]!r})"
    return ".".join(parts) or "(root)"


# top-level sections of configs written before each testbed owned its section
MOVED_INTO_TESTBED = {"model": "testbed.model", "scheduler": "testbed.scheduler", "pretrain": "testbed.pretrain",
                      "reward": "testbed.reward", "arith": "testbed (with name: arith)",
                      "text_to_image": "testbed (with name: text_to_image)"}


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = _where(e["loc"])
        moved = (f" (this section now lives in {MOVED_INTO_TESTBED[where]})"
                 if e["type"] == "extra_forbidden" and where in MOVED_INTO_TESTBED else "")
        lines.append(f"  {where}: {e['msg']}{moved}" + (f" (got {e['input']!r})" if e["type"] != "extra_forbidden" and
                                                          not isinstance(e.get("input"), dict) else ""))
    return "invalid config:\n" + "\n".join(lines)


def _switched(section: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    key, default = SWITCHES.get(section, (None, None))
    return key is not None and key in new and new[key] != old.get(key, default)


def merge_trees(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, section by section; a switched objective/sampler section replaces the base's."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not _switched(k, out[k], v):
            out[k] = merge_trees(out[k], v)
        else:
            out[k] = v
    return out


def read_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A preset's mapping; `base: other.yaml` (relative to the preset) is read first and merged under it."""
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"config file {str(path)!r} includes itself through `base:`")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at top level")
    if isinstance(tree.get("testbed"), str):  # `testbed: arith` is short for `testbed: {name: arith}`
        tree["testbed"] = {"name": tree["testbed"]}
    base = tree.pop("base", None)
    if base is None:
        return tree
    return merge_trees(read_tree(path.parent / str(base), (*seen, path.resolve())), tree)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Load a YAML preset (default: configs/digits-grpo.yaml), apply overrides, validate.

    Overrides that switch `objective.name`, `sampler.kind` or `testbed.name` apply first and reset that section,
    so `objective.name=gardo.paper objective.kl_coef=0.01` gives GARDO's defaults plus that one change.
    An installed plug-in package that could not join (rollout/plugins.py) is an error here, before anything else."""
    check_plugins()
    tree = read_tree(Path(path) if path is not None else DEFAULT_CONFIG)
    parsed = [("testbed.name", v) if k == "testbed" and isinstance(v, str) else (k, v)  # testbed=arith
              for k, v in map(parse_override, overrides)]
    switches = {f"{section}.{key}" for section, (key, _) in SWITCHES.items()}
    for key, value in sorted(parsed, key=lambda kv: kv[0] not in switches):  # stable: switches first
        section = key.split(".")[0]
        if key in switches and isinstance(tree.get(section), dict) and _switched(section, tree[section],
                                                                                 {key.split(".")[1]: value}):
            tree[section] = {}
        _set(tree, key, value)
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
