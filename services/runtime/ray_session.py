"""Starting (or joining) Ray and Serve, and keeping actor logs in the run folder."""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import ray
from ray import serve

from steadyrl.rollout.cache import cache_root, torch_extensions_dir
from steadyrl.services.config import ServeConfig, TrainConfig
from steadyrl.services.runtime.rank_env import free_port, set_rank_env  # noqa: F401 - also imported from here
from steadyrl.services.runtime.signals import stop_on_sigterm
from steadyrl.services.testbeds.base import Testbed

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def worker_env() -> dict[str, str]:
    """Environment every actor gets: offline hub, the shared cache and compiled-op dirs."""
    env = dict(OFFLINE_ENV)
    env["STEADYRL_CACHE"] = str(cache_root())
    env["TORCH_EXTENSIONS_DIR"] = str(torch_extensions_dir())
    env["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR", "cpu")
    return env


def job_env_vars() -> dict[str, str]:
    """env_vars of the runtime env `ray job submit` (or a RayJob's runtimeEnvYAML) gave this driver.

    Ray refuses to merge a driver's runtime env that sets any of the same keys, so ours leaves them out."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return {}
    return dict((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {})


def init_ray(address: str | None = None, num_cpus: int | None = None, local_network: str = "loopback",
             worker_niceness: int = 0) -> str:
    """Join a running Ray (address / $RAY_ADDRESS) or start a local one, listening on loopback only unless
    `local_network` is "all" (`ray.local_network`), whose workers run at this process's niceness +
    `worker_niceness` (`ray.worker_niceness`; Ray's own default is 15; a joined cluster keeps its own).
    SIGTERM then stops this process like Ctrl-C (`signals.stop_on_sigterm`, replacing the handler `ray.init`
    installs).

    Returns 'existing' (this process was already connected), 'joined' (connected to a running
    cluster, e.g. inside `ray job submit`) or 'local' (started a new local Ray).
    """
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return "existing"
    joining = address or os.environ.get("RAY_ADDRESS")
    logging.getLogger("ray").setLevel(logging.WARNING)
    loopback = _listens_on_loopback_only(joining) if joining else local_network == "loopback"
    with _node_address_on_loopback(loopback):
        ray.init(
            address=address,
            num_cpus=None if joining else num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            runtime_env={"env_vars": {k: v for k, v in worker_env().items() if k not in job_env_vars()}},
            configure_logging=True,
            _system_config=None if joining else {"worker_niceness": worker_niceness},
        )
    stop_on_sigterm()
    return "joined" if joining else "local"


def _listens_on_loopback_only(address: str) -> bool:
    """Whether `address` is a Ray on this machine that listens on loopback only (one started with
    `ray.local_network=loopback`): it must then be joined on loopback too, since Ray turns 127.0.0.1 into this
    machine's network address, where nothing answers."""
    from ray._private.services import get_node_ip_address

    host, _, port = address.split("://")[-1].rpartition(":")
    if host.strip("[]") not in ("127.0.0.1", "localhost", "::1") or not port.isdigit():
        return False
    try:
        socket.create_connection((get_node_ip_address(), int(port)), timeout=1).close()
    except OSError:
        return True
    return False


@contextmanager
def _node_address_on_loopback(loopback: bool) -> Iterator[None]:
    """While a local Ray starts, take 127.0.0.1 as this node's address, as Ray itself does on macOS and Windows
    (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`): every server it starts (GCS, raylet, object manager, agents,
    Prometheus metrics) then binds loopback instead of all interfaces."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = before and not loopback
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def start_serve(cfg: ServeConfig, logs_dir: Path | None = None) -> tuple[bool, int]:
    """Start Serve's HTTP proxy on cfg.host:cfg.port (0 = a free port) unless it already runs.

    Returns (started_here, port).
    """
    for name in ("ray.serve", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        status = serve.status()
        running = status.proxies is not None and len(status.proxies) > 0
    except Exception:
        running = False
    if running:
        return False, current_serve_port()
    port = cfg.port or free_port()
    logging_config = {"log_level": "WARNING"}
    if logs_dir is not None:
        logs_dir.mkdir(parents=True, exist_ok=True)
        logging_config["logs_dir"] = str(logs_dir)
    serve.start(http_options={"host": cfg.host, "port": port}, logging_config=logging_config)
    return True, port


@contextmanager
def reward_app_session(cfg: TrainConfig, testbed: Testbed) -> Iterator[int]:
    """Ray started (or joined), Serve's proxy up and `testbed`'s reward app deployed (`steadyrl serve-reward`);
    yields the proxy's port. On exit Serve and Ray shut down: their processes go with this one (Ray's atexit hook
    would run too late for a signal)."""
    from steadyrl.services.runtime.node_fit import check_roles_fit, reward_demand
    from steadyrl.services.serving import deploy_reward_app

    init_ray(cfg.ray.address, cfg.ray.num_cpus, cfg.ray.local_network, cfg.ray.worker_niceness)
    try:
        if cfg.ray.check_nodes:
            check_roles_fit([reward_demand(cfg, testbed)])
        _, bound = start_serve(cfg.serve)
        deploy_reward_app(testbed, cfg.serve, placement=cfg.ray.roles.reward)
        yield bound
    finally:
        serve.shutdown()
        ray.shutdown()


def current_serve_port() -> int:
    from ray.serve.context import _get_global_client

    return int(_get_global_client().http_config.port)


def redirect_output(log_file: Path) -> None:
    """Send this process's stdout/stderr (and Python logging) to `log_file`."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO, force=True, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
