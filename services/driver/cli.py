"""The `steadyrl` command line: train, pretrain, serve-reward, eval."""
from __future__ import annotations

import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from steadyrl.services.config import ConfigError, load_config
from steadyrl.services.runtime.signals import stop_on_sigterm

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
    os.environ.setdefault(_k, _v)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="steadyrl: stable RL fine-tuning of diffusion models on Ray.")
console = Console()


def _fail(message: str) -> None:
    """Print an error (unwrapped, so paths and field names stay whole) and exit with status 2."""
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(2)


def _require_models(testbed, rewards_only: bool = False):
    """`testbed`, once the models it loads are to be had (else the error naming each, before anything is built)."""
    try:
        testbed.require_models(rewards_only)
    except ConfigError as err:
        _fail(str(err))
    return testbed


def _split_args(args: list[str]) -> tuple[Optional[str], list[str]]:
    """First argument is a config file unless it looks like key=value."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _load(args: list[str]):
    config, overrides = _split_args(args)
    try:
        return config, overrides, load_config(config, overrides)
    except ConfigError as err:
        _fail(str(err))


@app.command(context_settings={"allow_extra_args": False})
def train(
    args: list[str] = typer.Argument(None, help="[CONFIG] key.sub=value ... (default configs/digits-grpo.yaml)"),
    resume: Optional[Path] = typer.Option(None, help="continue the run in this folder from its latest checkpoint"),
    allow_changes: bool = typer.Option(False, help="with --resume: accept overrides that change what the run "
                                       "computes (objective, sampler, seed, ...); recorded in resumes.jsonl"),
    local: bool = typer.Option(False, "--local", help="run the same loop in this process, without Ray or Serve "
                               "(run.runtime=local): for debugging and many-seed benchmarks"),
) -> None:
    """Pretrain if needed, then RL through local Ray (rollout actor -> Serve rewards -> DeepSpeed learner), or
    in one process with --local."""
    from steadyrl.services.driver.api import train as run_train  # `steadyrl.train`: this command is a layer over it
    from steadyrl.services.run_folder.checkpoints import RunFailed

    stop_on_sigterm()  # `kill PID` stops like Ctrl-C: checkpoint kept, Ray shut down, exit status 143
    args = list(args or [])
    if allow_changes and resume is None:
        _fail("--allow-changes only applies with --resume")
    if resume is not None:
        if args and "=" not in args[0]:
            _fail("with --resume the config comes from the run folder; pass only overrides")
        if not (resume / "config.yaml").exists():
            _fail(f"--resume {resume}: no config.yaml there")
    config, overrides = (None, args) if resume is not None else _split_args(args)
    try:
        run = run_train(config, overrides, runtime="local" if local else None, resume=resume,
                        allow_changes=allow_changes, console=console)
    except ConfigError as err:  # a bad config or override, Ray missing, a model not to be had: before anything runs
        _fail(str(err))
    except FileNotFoundError as err:
        if resume is None:
            raise
        _fail(str(err))  # --resume: no checkpoint to resume from
    except RunFailed as err:
        _run_failed(err)
    raise typer.Exit(run.result.exit_status)


def _run_failed(err: Exception) -> None:
    """A run stopped by a failure it could not recover from: the message says how to resume; exit status 1."""
    console.print(f"[red]run failed:[/red] {err}", soft_wrap=True)
    raise typer.Exit(1)


@app.command()
def pretrain(args: list[str] = typer.Argument(None, help="[CONFIG] key.sub=value ...")) -> None:
    """Build (or find cached) the testbed's pre-trained model and its reward models (digits: the
    classifier ensemble and gold monitor; arith: nothing to build, the verifier is exact)."""
    from steadyrl.services.testbeds import build_testbed

    _, _, cfg = _load(args or [])
    testbed = _require_models(build_testbed(cfg))
    console.print(f"{testbed.name} base model: {testbed.base_weights()}")
    testbed.prepare_rewards(console)


@app.command("serve-reward")
def serve_reward(
    args: list[str] = typer.Argument(None, help="[CONFIG] key.sub=value ..."),
    host: Optional[str] = typer.Option(None, help="address the HTTP proxy binds (default serve.host, 127.0.0.1: "
                                       "this machine only; 0.0.0.0 exposes it to the network)"),
    port: Optional[int] = typer.Option(None, help="HTTP port (default serve.port, 8000; 0 picks a free one)"),
) -> None:
    """Start the reward-ensemble Serve application alone and serve it until Ctrl-C or SIGTERM."""
    from steadyrl.services.driver.controller import require_ray

    try:
        require_ray("serve-reward (a Ray Serve application)", instead="")
    except ConfigError as err:
        _fail(str(err))
    from steadyrl.services.runtime.ray_session import reward_app_session
    from steadyrl.services.serving import HEALTH_ROUTE, MODELS_ROUTE, ROUTE_PREFIX, SCORE_ROUTE
    from steadyrl.services.testbeds import build_testbed

    stop_on_sigterm()
    extra = ([f"serve.host={host}"] if host is not None else []) + ([f"serve.port={port}"] if port is not None else [])
    _, _, cfg = _load((args or []) + extra)
    s = cfg.serve
    try:  # read the token (and drop its variable from the environment) before Ray starts; fail here if missing
        auth = s.token_sha256() is not None
    except ValueError as err:
        _fail(str(err))
    testbed = _require_models(build_testbed(cfg), rewards_only=True)
    testbed.prepare_rewards()
    with ExitStack() as session:
        try:
            bound = session.enter_context(reward_app_session(cfg, testbed))
        except ConfigError as err:  # a role no node can host (ray.roles.reward, serve.replica_gpus)
            _fail(str(err))
        base = f"http://{s.host}:{bound}{ROUTE_PREFIX}"
        where = "this machine only" if s.host in ("127.0.0.1", "localhost", "::1") else "reachable from the network"
        token = (f"needs `Authorization: Bearer <token>` (token from "
                 f"{'$' + s.auth_token_env if s.auth_token_env else s.auth_token_file})" if auth else "no token needed")
        lines = [f"reward ensemble ({cfg.testbed.name}) on {s.host}:{bound} ({where}); {token}",
                 f"  POST {base}{SCORE_ROUTE}    score samples (at most {s.max_request_samples} per request, "
                 f"bodies up to {s.max_body_bytes} bytes)",
                 f"  GET  {base}{MODELS_ROUTE}   the reward models",
                 f"  GET  {base}{HEALTH_ROUTE}      health (open without a token)",
                 f"  docs {base}/docs         OpenAPI: {base}/openapi.json"]
        for line in lines:
            console.print(line, soft_wrap=True, highlight=False, markup=False)
        sys.stdout.flush()
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (`signals.Terminated`)
            console.print("shutting down")


@app.command("eval")
def eval_cmd(
    run_dir: Path = typer.Argument(..., help="a run folder written by `steadyrl train`"),
    step: Optional[int] = typer.Option(None, help="checkpoint step (default: latest)"),
    samples_per_prompt: Optional[int] = typer.Option(None, help="samples per held-out prompt (default: the testbed's)"),
    seed: Optional[int] = typer.Option(None, help="default: the run's eval_seed"),
) -> None:
    """Score a checkpoint: held-out accuracy (per class / answer length), training reward, diversity, samples."""
    from steadyrl.services.driver.evaluate import evaluate_checkpoint

    if not (run_dir / "config.yaml").exists():
        _fail(f"{run_dir} is not a run folder (no config.yaml)")
    try:
        res = evaluate_checkpoint(run_dir, step, samples_per_prompt, seed)
    except FileNotFoundError as err:
        _fail(str(err))
    from steadyrl.services.config import load_config
    from steadyrl.services.testbeds import build_testbed

    testbed = build_testbed(load_config(run_dir / "config.yaml"))
    table = Table(title=f"eval of {res['checkpoint']} ({res['n_samples']} samples)")
    table.add_column("prompts")
    table.add_column(testbed.labels[1], justify="right")
    for key, a in res["breakdown"].items():
        table.add_row(key, testbed.headline(a, breakdown=True))
    table.add_row("[bold]all", f"[bold]{testbed.headline(res['held_out'])}")
    console.print(table)
    console.print(f"proxy reward {res['proxy_mean']:.3f}   diversity (nn) {res['diversity_nn']:.2f}   "
                  f"samples: {Path(res['checkpoint']).parents[1] / ('eval_' + Path(res['checkpoint']).name)}/")


@app.command("sample")
def sample_cmd(
    run_dir: Path = typer.Argument(..., help="a run folder written by `steadyrl train`"),
    out: Path = typer.Argument(..., help="a .png (image testbeds) or .txt (language models) file, or a folder "
                               "(samples_step_N.png / .txt in it)"),
    prompts: Optional[str] = typer.Option(None, help="a .txt (one a line) or .jsonl (\"prompt\" a line) prompts "
                                          "file, or a prompt's text: digits \"3\" or \"0,1,2\", arith \"07+45=\", "
                                          "a text-to-image prompt (default: the held-out evaluation prompts)"),
    step: Optional[int] = typer.Option(None, help="checkpoint step (default: the latest)"),
    n: int = typer.Option(4, "--n", min=1, help="samples of each prompt (a grid row, or a prompt's completions)"),
    seed: int = typer.Option(0, help="generator seed: the same seed draws the same samples"),
    steps: Optional[int] = typer.Option(None, min=1, help="denoising steps (sampler.num_steps; default the run's)"),
) -> None:
    """Sample a checkpoint's policy (its evaluation sampler, seeded) and write the samples to look at: a PNG grid
    (a row per prompt, its samples across) or a text file (each prompt, then its completions)."""
    from steadyrl.services.driver.api import load_run
    from steadyrl.services.driver.samples import SUFFIXES, read_prompts
    from steadyrl.services.run_folder.reader import NotARunFolder
    from steadyrl.services.testbeds.base import PromptError

    if out.suffix and not out.is_dir() and out.suffix.lower() not in SUFFIXES:
        _fail(f"{out}: samples are written as a {' or '.join(SUFFIXES)} file, or into a folder")
    try:
        run = load_run(run_dir)
        texts = None if prompts is None else read_prompts(prompts)
        if not run.checkpoints:
            _fail(f"{run_dir} has no checkpoints (checkpoints/step_N): train it until `run.checkpoint_every`")
        if step is not None and step not in run.checkpoints:
            _fail(f"--step {step}: {run_dir} has no checkpoint of that step; it has steps {run.checkpoints}")
        samples = run.sample(n, seed=seed, step=step, prompts=texts, steps=steps)
    except (NotARunFolder, PromptError, ConfigError) as err:
        _fail(str(err))
    try:
        path = samples.save(out)
    except ValueError as err:  # OUT's suffix does not fit the samples: .png for images, .txt for texts
        _fail(str(err))
    console.print(f"{path}: {len(samples)} samples ({samples.per_prompt} of each of {len(samples) // n} prompts)",
                  soft_wrap=True, highlight=False, markup=False)


@app.command("export")
def export_cmd(
    run_dir: Path = typer.Argument(..., help="a run folder written by `steadyrl train`"),
    out: Path = typer.Argument(..., help="the folder to write (new or empty)"),
    step: Optional[int] = typer.Option(None, help="checkpoint step (default: the latest)"),
    merge: bool = typer.Option(False, help="LoRA: fuse the adapters into a whole model folder instead of writing "
                               "the adapters alone"),
    overwrite: bool = typer.Option(False, help="replace OUT when it is not empty"),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", metavar="REPO",
                                              help="then upload OUT to this Hugging Face Hub model repository "
                                              "(made if missing; needs the network: HF_HUB_OFFLINE=0, and a token)"),
) -> None:
    """Export a checkpoint in the format diffusers, transformers, peft or vLLM loads, with a model card."""
    from steadyrl.services.driver.export import ExportError, export_run
    from steadyrl.services.run_folder.reader import NotARunFolder

    command = " ".join(["steadyrl", *sys.argv[1:]]) if sys.argv[1:2] == ["export"] else "steadyrl export"
    try:
        folder, info = export_run(run_dir, out, step, merge, overwrite, command=command)
    except (ExportError, NotARunFolder, NotImplementedError) as err:
        _fail(str(err))
    console.print(f"{folder}: {info.format}", soft_wrap=True, highlight=False, markup=False)
    console.print(info.load.replace("{path}", str(folder)), soft_wrap=True, highlight=False, markup=False)
    if push_to_hub is not None:
        _push(folder, push_to_hub)


def _push(folder: Path, repo: str) -> None:
    """`export --push-to-hub REPO`: the complete export folder uploaded; a failure says the folder is intact."""
    from steadyrl.services.driver.export import ExportError, push_to_hub

    try:
        url = push_to_hub(folder, repo)
    except ExportError as err:
        _fail(f"{err}. {folder} is complete.")
    except Exception as err:  # huggingface_hub's: no token, no such user, no network, ...
        _fail(f"--push-to-hub {repo}: the upload failed ({type(err).__name__}: {err}). {folder} is complete: "
              f"upload it with `hf upload {repo} {folder}`")
    console.print(f"pushed to {url}", soft_wrap=True, highlight=False, markup=False)


def _hacking_rule(min_proxy_gain: float, min_gold_drop: float, max_diversity_drop: float):
    """The verdict's thresholds from the command line; a bad one fails naming its option."""
    from pydantic import ValidationError

    from steadyrl.services.run_folder.reader import HackingRule

    try:
        return HackingRule(min_proxy_gain=min_proxy_gain, min_gold_drop=min_gold_drop,
                           max_diversity_drop=max_diversity_drop)
    except ValidationError as err:
        e = err.errors()[0]
        _fail(f"--{e['loc'][0].replace('_', '-')}: {e['msg']} ({e['input']!r})")


_PROXY_GAIN = typer.Option(0.02, help="verdict: proxy rise since the base eval that, with the gold drop, "
                           "flags reward hacking")
_GOLD_DROP = typer.Option(0.02, help="verdict: held-out (gold) drop since the base eval that, with the proxy rise, "
                          "flags reward hacking")
_DIVERSITY_DROP = typer.Option(0.5, help="verdict: relative fall of nearest-neighbour diversity that flags it alone")
_TARGET = typer.Option(None, help="a held-out level (e.g. 0.95): the first evaluated step at or above it, the "
                       "seconds of training steps and the samples until then")


@app.command("inspect")
def inspect_cmd(
    run_dir: Path = typer.Argument(..., help="a run folder written by `steadyrl train`"),
    out: Optional[Path] = typer.Option(None, help="where dashboard.png and report.html go (default RUN_DIR/report)"),
    min_proxy_gain: float = _PROXY_GAIN, min_gold_drop: float = _GOLD_DROP,
    max_diversity_drop: float = _DIVERSITY_DROP, target: Optional[float] = _TARGET,
) -> None:
    """Key metrics, base vs final eval, rollbacks/anomalies and the reward-hacking verdict as tables; the
    training-health dashboard (PNG) and a one-page HTML report; with --target, the time to that held-out."""
    from steadyrl.services.run_folder.inspection import inspect_run, inspection_tables
    from steadyrl.services.run_folder.reader import NotARunFolder

    rule = _hacking_rule(min_proxy_gain, min_gold_drop, max_diversity_drop)
    try:
        ins = inspect_run(run_dir, out, rule, target)
    except NotARunFolder as err:
        _fail(str(err))
    for table in inspection_tables(ins):
        console.print(table)
    console.print(f"events: {len(ins.run.rollbacks)} rollback(s), {len(ins.run.anomalies)} anomaly event(s)")
    colour = {None: "yellow", True: "red", False: "green"}[ins.verdict.suspected]
    console.print(f"[bold {colour}]{ins.verdict.text}[/]", soft_wrap=True)
    console.print(f"rule: {ins.verdict.rule}", soft_wrap=True, highlight=False)
    console.print(f"dashboard: {ins.dashboard or '(nothing to plot yet)'}\nreport:    {ins.report}", soft_wrap=True)


@app.command("compare")
def compare_cmd(
    run_dirs: list[Path] = typer.Argument(..., help="two or more run folders"),
    out: Path = typer.Option(Path("compare"), help="where compare.png goes"),
    metric: Optional[list[str]] = typer.Option(None, help="a metrics.jsonl key (or eval/<field> of evals.json) to "
                                               "overlay; repeat for more (default: proxy and gold rewards, eval "
                                               "gold, KL to the reference, diversity, gradient norm)"),
    min_proxy_gain: float = _PROXY_GAIN, min_gold_drop: float = _GOLD_DROP,
    max_diversity_drop: float = _DIVERSITY_DROP, target: Optional[float] = _TARGET,
) -> None:
    """Overlay the curves of several runs (labelled by folder name) in one PNG, and tabulate their final values;
    with --target, each run's time to that held-out and a PNG of held-out against training seconds."""
    from steadyrl.services.run_folder.inspection import compare_runs, comparison_table, to_target_table
    from steadyrl.services.run_folder.reader import NotARunFolder, run_labels

    rule = _hacking_rule(min_proxy_gain, min_gold_drop, max_diversity_drop)
    if len(run_dirs) < 2:
        _fail("compare needs at least two run folders")
    try:
        cmp = compare_runs(run_dirs, out, metric, target)
    except NotARunFolder as err:
        _fail(str(err))
    except KeyError as err:
        _fail(err.args[0])
    console.print(comparison_table(cmp, rule))
    if cmp.to_target is not None:
        console.print(to_target_table(run_labels(cmp.runs), cmp.to_target))
    console.print(f"figure: {cmp.figure}" + (f"\nheld-out against time: {cmp.time_figure}" if cmp.time_figure
                                              else ""), soft_wrap=True)


if __name__ == "__main__":
    app()
