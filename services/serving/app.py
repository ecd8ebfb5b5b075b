"""The reward ensemble as a Ray Serve application: bind the deployments of a testbed's reward spec
(`build_reward_app`), deploy or reuse it (`deploy_reward_app`), and the builder a Serve config names
(`import_path: steadyrl.services.serving.app:app_builder`)."""

import hashlib
import json
from typing import TYPE_CHECKING, Any

from ray import serve

from steadyrl.reward.ensemble_spec import EnsembleSpec
from steadyrl.services.config import RolePlacement, ServeConfig
from steadyrl.services.serving.deployments import IngressSettings, RewardEnsembleIngress, RewardModelDeployment
from steadyrl.services.serving.guard import RestSettings
from steadyrl.services.testbeds.rest import RestProfile

if TYPE_CHECKING:
    from steadyrl.services.testbeds.base import Testbed

APP_NAME = "reward"
ROUTE_PREFIX = "/reward"
# ServeConfig fields that shape the app (host/port are the proxy's; timeouts and retries are the callers')
APP_SETTINGS = ("replica_cpus", "replica_gpus", "colocate_models", "batching", "max_batch_size",
                "batch_wait_timeout_s", "max_ongoing_requests", "max_request_samples", "max_body_bytes",
                "body_timeout_s", "body_idle_timeout_s", "max_unfinished_bodies")


def build_reward_app(testbed: "Testbed", serve_cfg: ServeConfig | None = None,
                     placement: RolePlacement | None = None) -> serve.Application:
    """Bind one deployment per model of the testbed's reward ensemble (`Testbed.reward_spec`) and the ensemble
    ingress with the testbed's REST profile (`Testbed.rest`). Deployments are named `reward_<name>` (members)
    and `monitor_<name>` (watch only); with `serve.colocate_models` there are none: the ingress hosts the models.
    The bearer token (if `serve_cfg` asks for one) is read once (`ServeConfig.token_sha256`, here unless the
    caller read it before Ray started); only its SHA-256 goes to the replicas."""
    serve_cfg, placement = serve_cfg or ServeConfig(), placement or RolePlacement()
    spec, profile, rest = testbed.reward_spec(), testbed.rest, RestSettings.from_config(serve_cfg)
    return _bind(spec, profile, serve_cfg, rest, placement, _digest(spec, profile, serve_cfg, rest, placement))


def _bind(spec: EnsembleSpec, profile: RestProfile, serve_cfg: ServeConfig, rest: RestSettings,
          placement: RolePlacement, digest: str) -> serve.Application:
    """The deployments and the ingress of `build_reward_app` (every replica on the nodes `placement` names), with
    the token's digest and the app's digest."""
    opts: dict[str, Any] = {"ray_actor_options": {"num_cpus": serve_cfg.replica_cpus, **placement.ray_options()},
                            "max_ongoing_requests": serve_cfg.max_ongoing_requests}
    batching = {"max_batch_size": serve_cfg.max_batch_size, "batch_wait_timeout_s": serve_cfg.batch_wait_timeout_s,
                "batching": serve_cfg.batching}

    def with_gpu(model_opts: dict[str, Any], *model_specs: Any) -> dict[str, Any]:
        """A replica hosting a model on cuda reserves its GPU share."""
        if not _on_cuda(*model_specs):
            return model_opts
        return {**model_opts, "ray_actor_options": {**model_opts["ray_actor_options"],
                                                    "num_gpus": serve_cfg.replica_gpus}}

    def model(name: str, model_spec: Any) -> serve.Application | dict[str, Any]:
        if serve_cfg.colocate_models:  # built by the ingress, in its process
            return model_spec.model_dump()
        return RewardModelDeployment.options(name=name, **with_gpu(opts, model_spec)).bind(model_spec.model_dump(),
                                                                                          **batching)

    members = {m.name: model(f"reward_{m.name}", m) for m in spec.members}
    monitors = {m.name: model(f"monitor_{m.name}", m) for m in spec.monitors}
    settings = IngressSettings(profile=profile, train_on=spec.train_on, feature_model=spec.feature_model,
                               correct=tuple(spec.correct), rest=rest, digest=digest, weighting=spec.weighting)
    ingress_opts = with_gpu(opts, *spec.members, *spec.monitors) if serve_cfg.colocate_models else opts
    ingress = RewardEnsembleIngress.options(name="ensemble", **ingress_opts)
    return ingress.bind(members=members, monitors=monitors, settings=settings)


def _on_cuda(*model_specs: Any) -> bool:
    return any(getattr(m, "device", "cpu").startswith("cuda") for m in model_specs)


def replica_gpus(spec: EnsembleSpec, serve_cfg: ServeConfig) -> float:
    """The GPU share the app's largest replica asks Ray for: `serve.replica_gpus` where a model runs on cuda."""
    return serve_cfg.replica_gpus if _on_cuda(*spec.members, *spec.monitors) else 0.0


def app_digest(spec: EnsembleSpec, profile: RestProfile, serve_cfg: ServeConfig,
               placement: RolePlacement | None = None) -> str:
    """SHA-256 of what an app is built from: the ensemble's spec, the testbed it serves, the settings that shape
    the deployments and the REST API, the nodes its replicas run on, and the bearer token's own digest."""
    return _digest(spec, profile, serve_cfg, RestSettings.from_config(serve_cfg), placement or RolePlacement())


def _digest(spec: EnsembleSpec, profile: RestProfile, serve_cfg: ServeConfig, rest: RestSettings,
            placement: RolePlacement) -> str:
    from importlib.metadata import version

    payload = {"steadyrl": version("steadyrl"), "testbed": profile.testbed, "spec": spec.model_dump(mode="json"),
               "serve": {k: getattr(serve_cfg, k) for k in APP_SETTINGS}, "token": rest.token_sha256}
    if placement.ray_options():  # (left out when unset: the digest of an app placed anywhere stays as it was)
        payload["placement"] = placement.model_dump(mode="json")
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def running_app_digest(name: str = APP_NAME) -> str | None:
    """The digest of the app `name` if it is deployed and RUNNING (None otherwise)."""
    app = serve.status().applications.get(name)
    if app is None or app.status != "RUNNING":
        return None
    try:
        return serve.get_app_handle(name).app_digest.remote().result(timeout_s=30)
    except Exception:  # noqa: BLE001 - an app of another build (no app_digest) or not answering: not ours
        return None


def deploy_reward_app(testbed: "Testbed", serve_cfg: ServeConfig | None = None, name: str = APP_NAME,
                      route_prefix: str = ROUTE_PREFIX, reuse: bool = False,
                      placement: RolePlacement | None = None) -> bool:
    """Deploy (or update) the ensemble as the Serve application `name` (default `reward`) under `route_prefix`
    (default /reward). With `reuse`, an app of that name already running the same ensemble (same `app_digest`:
    a RayService's, or an earlier run's on this cluster) is left as it is. Returns whether it deployed."""
    serve_cfg, placement = serve_cfg or ServeConfig(), placement or RolePlacement()
    spec, profile, rest = testbed.reward_spec(), testbed.rest, RestSettings.from_config(serve_cfg)
    digest = _digest(spec, profile, serve_cfg, rest, placement)
    if reuse and route_prefix == ROUTE_PREFIX and running_app_digest(name) == digest:
        return False
    serve.run(_bind(spec, profile, serve_cfg, rest, placement, digest), name=name, route_prefix=route_prefix)
    return True


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve config entry point (`import_path: steadyrl.services.serving.app:app_builder`, as in
    deploy/rayservice-reward.yaml): args `config` (a preset) and `overrides` (key=value), as on the command line."""
    from steadyrl.services.config import load_config
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(args.get("config"), list(args.get("overrides") or []))
    testbed = build_testbed(cfg)
    testbed.prepare_rewards()
    return build_reward_app(testbed, cfg.serve, cfg.ray.roles.reward)
