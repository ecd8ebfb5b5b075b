"""Helpers shared by several test modules: import them as `from tests.helpers import ...`.

Fixtures stay in conftest.py; the tiny diffusers/CLIP builders are in tests/tiny_models.py. Everything that
needs Ray, Serve or the controller is imported inside the function using it, so that importing this module
stays cheap for the tests that run without Ray.
"""
from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from steadyrl.rollout.arith import TOKENIZER, ArithTask
from steadyrl.rollout.config import (DDIMSamplerConfig, FlowSDESamplerConfig, MaskedDiffusionSamplerConfig,
                                     SchedulerConfig, UNetConfig)
from steadyrl.rollout.masked_lm import MaskedLMConfig
from steadyrl.trainer.config import LearnerConfig

# ------------------------------------------------------------------------------- docs' examples
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_FILE_MARKER = re.compile(r"^(?:#|//) ([\w./-]+\.\w+)$")


def doc_files(markdown: Path) -> dict[str, str]:
    """{file name: text} of a Markdown page's fenced blocks whose first line names a file, `# path/name.ext` (or
    `// path/name.ext`), so a test can write and run a page's examples as they are printed; the marker line is
    kept (a comment in each of those languages). A name given twice is an error."""
    files: dict[str, str] = {}
    for block in _FENCE.findall(Path(markdown).read_text()):
        marker = _FILE_MARKER.match(block.split("\n", 1)[0])
        if marker is None:
            continue
        name = marker.group(1)
        assert name not in files, f"{markdown}: two blocks are named {name}"
        files[name] = block
    return files


def write_files(root: Path, files: dict[str, str]) -> Path:
    """`files` ({relative path: text}) written under `root`; returns `root`."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


# ------------------------------------------------------------------------------- runs of the real services
# The short smoke run that the resume, fault-tolerance and weight-sync tests each compare their run with.
SMOKE_SHORT = ["run.steps=6", "run.checkpoint_every=3", "run.eval_every=3", "testbed.eval_samples_per_class=2",
               "sampler.group_size=4", "run.progress=false"]
# wall-clock figures, fault counters, and bytes through the driver (runtime-dependent: 0 on the local runtime)
VOLATILE_METRICS = ("timing_s/", "perf/", "faults/", "handoff/")


def computed_metrics(rows: list[dict]) -> list[dict]:
    """A run's metrics rows without the keys two runs of the same computation may differ in."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE_METRICS)} for r in rows]


def make_testbed(settings: Any) -> Any:
    """The testbed of a `testbed:` section alone (with the first sampler kind that fits it)."""
    from steadyrl.services.config import TrainConfig
    from steadyrl.services.testbeds import build_testbed

    return build_testbed(TrainConfig.model_validate({"testbed": settings.model_dump(),
                                                     "sampler": {"kind": settings.sampler_kinds[0]}}))


def ensure_digits_app() -> None:
    """The default digits reward ensemble deployed as configs/smoke.yaml serves it (again, if a run or test
    replaced it). Digits runs find it serving their ensemble and use it instead of deploying their own."""
    from steadyrl.services.config import CONFIG_DIR, load_config
    from steadyrl.services.serving import deploy_reward_app
    from steadyrl.services.testbeds import DigitsSettings

    deploy_reward_app(make_testbed(DigitsSettings()), load_config(CONFIG_DIR / "smoke.yaml").serve, reuse=True)


def noise_off(kind: str) -> list[str]:
    """Overrides that turn a sampler's noise off (every step the deterministic DDIM / Euler step): the noise near 0
    and no SDE window (the default job's window would have no stochastic step left to hold)."""
    return ["sampler.noise_level=1e-12" if kind == "flow" else "sampler.eta=1e-12", "sampler.sde_window=null"]


def train_local(config: Path, run_dir: Path, overrides: list[str] = ()) -> tuple[Any, list[dict]]:
    """`steadyrl train --local`: the product loop in this process (no Ray, no Serve); (RunResult, metrics rows)."""
    from steadyrl.services.driver.controller import train
    from steadyrl.services.run_folder.metrics import read_metrics

    result = train(config, [f"run.run_dir={run_dir}", "run.runtime=local", "run.progress=false", *overrides])
    return result, read_metrics(result.run_dir)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 300) -> None:
    """Poll `condition` every 50 ms; fail the test naming `what` after `timeout_s`."""
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def steps_logged(run: Path) -> int:
    """Training steps a run has written to its metrics.jsonl so far."""
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def actor_pid(run: Path, actor: str) -> int:
    """The process id of a run's actor (`rollout_0`, `learner_0`, ...), from the run's actors file."""
    from steadyrl.services.driver.controller import ACTORS_FILE

    return int(json.loads((run / ACTORS_FILE).read_text())["actors"][actor]["pid"])


def train_in_thread(run: Path, overrides: list[str], config: Path | None = None
                    ) -> tuple[threading.Thread, dict[str, Any]]:
    """train() (configs/smoke.yaml unless `config`) on a thread of this process (the test's driver), so the main
    thread can kill its actors. The returned dict gets `result` or `error` when the run ends."""
    from steadyrl.services.config import CONFIG_DIR
    from steadyrl.services.driver.controller import train

    config = CONFIG_DIR / "smoke.yaml" if config is None else config
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = train(config, [f"run.run_dir={run}", *overrides])
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


# ------------------------------------------------------------------------------- tiny image learners
TINY_UNET = UNetConfig(block_out_channels=(8, 16), norm_num_groups=4)
IMAGE_FAMILIES = {"ddim": DDIMSamplerConfig(num_steps=5), "flow_sde": FlowSDESamplerConfig(num_steps=5)}


def tiny_learner(cfg: LearnerConfig, objective=None):
    """A DeepSpeed learner (gloo, this process, a fresh port) on the tiny class-conditional UNet, 5 DDIM steps,
    `objective` (default GRPO with eps_clip 0.2)."""
    from steadyrl.rollout.ddim import DDIMLogProbSampler
    from steadyrl.rollout.models import build_class_policy, build_scheduler
    from steadyrl.services.runtime.ray_session import free_port, set_rank_env
    from steadyrl.trainer.builders import build_deepspeed_learner
    from steadyrl.trainer.objectives.grpo import GRPOSettings

    set_rank_env(free_port())
    torch.manual_seed(0)
    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=5), build_scheduler(SchedulerConfig()))
    return build_deepspeed_learner(build_class_policy(TINY_UNET), sampler, objective or GRPOSettings(eps_clip=0.2),
                                   cfg, seed=0)


def make_image_learner(sampler_cfg, objective_cfg, seed: int = 0, **learner_kw):
    """A DeepSpeed learner on the tiny UNet with any image sampler and objective (lr 1e-3, micro-batches of 8,
    one inner epoch unless `learner_kw` says otherwise). The caller sets the rank environment."""
    from steadyrl.rollout.models import build_class_policy
    from steadyrl.rollout.sampler_factory import build_sampler
    from steadyrl.trainer.builders import build_deepspeed_learner

    torch.manual_seed(seed)
    sampler = build_sampler(sampler_cfg, SchedulerConfig())
    cfg = LearnerConfig(**{"lr": 1e-3, "micro_batch_size": 8, "inner_epochs": 1, **learner_kw})
    return build_deepspeed_learner(build_class_policy(TINY_UNET), sampler, objective_cfg, cfg, seed=seed)


def brightness_batch(learner, seed: int, n_per_class: int = 6):
    """A batch sampled with the learner's current weights (classes 0-3), rewarded by mean brightness
    (`bright`, the trained reward) plus a noisy second reward `aux`; features are the flat samples."""
    from steadyrl.rollout.models import build_class_policy

    policy = build_class_policy(TINY_UNET)
    policy.load_trainable_state_dict(learner.weights())
    b = learner.sampler.sample(policy, torch.arange(4), n_per_class, torch.Generator().manual_seed(seed))
    aux = torch.randn(len(b), generator=torch.Generator().manual_seed(seed + 1))
    r = b.samples.mean(dim=(1, 2, 3))
    return b.replace(rewards=torch.stack([r, r + 0.1 * aux], 1), reward_names=["bright", "aux"], reward_key="bright",
                     features=b.samples.flatten(1))


# ------------------------------------------------------------------------------- tiny masked-diffusion LM
TINY_MLM = MaskedLMConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=32)
MASK = TOKENIZER.mask_token_id


def tiny_lm(seed: int = 0, dtype=torch.float64):
    """A tiny random BERT masked LM over the arith character tokenizer (float64 by default), in eval mode."""
    from steadyrl.rollout.masked_lm import build_masked_lm

    torch.manual_seed(seed)
    return build_masked_lm(TINY_MLM, len(TOKENIZER)).to(dtype).eval()


def arith_prompts(n: int, seed: int = 0) -> torch.Tensor:
    """The encoded prompts of `n` addition problems of the default ArithTask, problem seed `seed`."""
    task = ArithTask()
    return task.encode_prompts(task.problems(seed, range(n)))


def masked_sampler(**kw):
    """A masked-diffusion sampler with the arith tokenizer's mask, EOS and pad ids; `kw` are
    MaskedDiffusionSamplerConfig fields."""
    from steadyrl.rollout.masked_diffusion import MaskedDiffusionSampler

    return MaskedDiffusionSampler(MaskedDiffusionSamplerConfig(**kw), MASK, TOKENIZER.eos_id, TOKENIZER.pad_id)


def after_first_eos(completion: torch.Tensor, eos: int = TOKENIZER.eos_id) -> torch.Tensor:
    """[B, L] True strictly after each row's first EOS (an independent loop, for checking `completion_valid`)."""
    out = torch.zeros_like(completion, dtype=torch.bool)
    for r, row in enumerate(completion.tolist()):
        if eos in row:
            out[r, row.index(eos) + 1:] = True
    return out


def update_error(after: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                 start: dict[str, torch.Tensor]) -> float:
    """||(after - start) - (reference - start)||_2 / ||reference - start||_2 over all tensors: how far one update is
    from another, judged against the update's own size. Summing a gradient in another order (pieces split, ranks
    all-reduced) moves float32 results by ~1e-7 of the gradient, which Adam's m / sqrt(v) turns into up to a whole
    step on the entries whose gradient is itself float noise: a few entries, a small L2 share; a wrong weighting
    moves every entry."""
    num = sum(float(((after[k] - reference[k]).double() ** 2).sum()) for k in reference)
    den = sum(float(((reference[k] - start[k]).double() ** 2).sum()) for k in reference)
    return (num / den) ** 0.5


def tiny_sd3_nft_learner(tmp_path: Path, settings: Any) -> tuple[Any, Any]:
    """A DiffusionNFT learner (`settings`) on a tiny random SD3 pipeline with LoRA, and one batch sampled from it,
    rewarded by its mean latent."""
    from safetensors.torch import load_file

    from steadyrl.services.config import load_config
    from steadyrl.services.runtime.ray_session import free_port, set_rank_env
    from steadyrl.services.testbeds import build_testbed
    from steadyrl.trainer.builders import build_deepspeed_learner
    from tests.tiny_models import save_tiny_sd3_pipeline

    set_rank_env(free_port())
    path = save_tiny_sd3_pipeline(tmp_path / "sd3")
    tb = build_testbed(load_config(None, [
        "testbed.name=text_to_image", f"testbed.pretrained={path}", "testbed.prompts.train=tiny",
        "testbed.prompts.prompts_per_step=2", "sampler.num_steps=4", "sampler.group_size=3",
        "sampler.kind=flow_sde", "sampler.shift=3.0", "objective.name=diffusion_nft.code"]))
    policy = tb.build_policy(load_file(str(tb.base_weights(progress=False))))
    sampler = tb.build_sampler()
    prompts, offset = tb.train_prompts(0, 2, 0)
    batch = tb.sample(sampler, policy, prompts, 3, torch.Generator().manual_seed(0), group_offset=offset)
    batch = batch.replace(rewards=batch.samples.mean(dim=tuple(range(1, batch.samples.dim()))).unsqueeze(1),
                          reward_names=["r"], reward_key="r")
    learner = build_deepspeed_learner(policy, sampler, settings,
                                      LearnerConfig(lr=1e-2, micro_batch_size=6, inner_epochs=1))
    return learner, batch


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """An ASGI app (a FastAPI scorer) served by uvicorn on 127.0.0.1 in a thread; yields its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), "the test server to start", timeout_s=30)
    assert server.started, "the test server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound and released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROLE_LABEL = "steadyrl.io/role"


@contextmanager
def on_loopback() -> Iterator[None]:
    """Ray nodes started inside listen on 127.0.0.1 only: Ray takes 127.0.0.1 as the node address while
    `ENABLE_RAY_CLUSTER` is off, as `init_ray` starts a local Ray."""
    from ray._private import ray_constants

    before, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def loopback_cluster(roles: dict[str, dict[str, float]]) -> tuple[Any, dict[str, Any]]:
    """A multi-node Ray on this machine: a head (1 CPU; the driver's node: Serve's controller and proxy) and one
    2-CPU raylet per role, each with its own object store, labelled `steadyrl.io/role: <role>` and carrying the
    role's custom resources, every server on 127.0.0.1. (cluster, {role: node})."""
    from ray.cluster_utils import Cluster

    with on_loopback():
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, node_ip_address="127.0.0.1", labels={ROLE_LABEL: "head"}, include_dashboard=False))
        nodes = {role: cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", labels={ROLE_LABEL: role},
                                        resources=resources)
                 for role, resources in roles.items()}
        cluster.wait_for_nodes()
    return cluster, nodes


def spy_on_log_prob(sampler) -> list[int]:
    """The steps `sampler.log_prob` is asked for from now on (the learner's recompute and its terms), appended to
    the list returned; the sampler still computes them."""
    asked: list[int] = []
    log_prob = sampler.log_prob

    def spy(policy, batch, step):
        asked.extend(torch.as_tensor(step).flatten().tolist())
        return log_prob(policy, batch, step)

    sampler.log_prob = spy
    return asked
