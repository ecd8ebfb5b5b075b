"""The Python API (`import steadyrl`): `steadyrl.train` computes what `steadyrl train` computes, bitwise; the `Run` it
returns reads its folder, reopens equal with `load_run`, loads the checkpoint's policy and samples from it; progress
outside a terminal is plain lines; `import steadyrl` loads neither torch nor Ray; and docs/python-api.md's example
runs as written (with a two-step run)."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

import steadyrl
from steadyrl.services.config import CONFIG_DIR, ConfigError, dump_config, load_config
from steadyrl.services.driver import api
from tests.helpers import computed_metrics

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "python-api.md"
# appended to the docs example's overrides: two steps, tiny evaluations, progress on (its plain lines are checked),
# one torch thread (two on a shared 2-core machine can make a step 50x slower)
TINY = ["run.steps=2", "run.eval_every=2", "run.checkpoint_every=2", "testbed.eval_samples_per_class=2",
        "sampler.group_size=4", "run.progress=true", "ray.torch_threads=1"]
LINE = re.compile(r"^RL (\d+)/2  proxy \d\.\d{3}  gold \d+\.\d%  KL \S+  \d+\.\d\ds/step  \d+:\d\d:\d\d elapsed$")


def doc_example() -> str:
    """The python block under docs/python-api.md's "In a notebook"."""
    section = DOC.read_text().split("## In a notebook", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def doc_run(tmp_path_factory):
    """docs/python-api.md's example executed as written, its `steadyrl.train` call given TINY, a run folder of its
    own and a console that is not a terminal: (the example's variables, the train call, what train printed)."""
    real, calls, out = steadyrl.train, [], io.StringIO()

    def two_steps(config, overrides=(), **kw):
        calls.append((ROOT / config, [*overrides, *TINY, f"run.run_dir={tmp_path_factory.mktemp('api') / 'run'}"],
                      kw))
        return real(calls[-1][0], calls[-1][1], console=Console(file=out, width=200), **kw)

    namespace: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steadyrl, "train", two_steps)
        exec(compile(doc_example(), str(DOC), "exec"), namespace)
    assert len(calls) == 1
    return namespace, calls[0], out.getvalue()


@pytest.fixture(scope="module")
def cli_run(doc_run, tmp_path_factory):
    """`steadyrl train` in a subprocess, its output a pipe, on the docs example's config and overrides."""
    _, (config, overrides, kw), _ = doc_run
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    local = ["--local"] if kw.get("runtime") == "local" else []
    out = subprocess.run([sys.executable, "-m", "steadyrl.services.driver.cli", "train", *local, str(config),
                          *overrides[:-1], f"run.run_dir={run_dir}"], cwd=run_dir.parent, capture_output=True,
                         text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir, out.stdout


def test_the_docs_example_runs_as_written(doc_run):
    namespace, (config, _, kw), _ = doc_run
    assert config == ROOT / "configs/digits-grpo.yaml" and kw["runtime"] == "local"
    run, samples = namespace["run"], namespace["samples"]
    assert isinstance(run, steadyrl.Run) and isinstance(samples, steadyrl.Samples)
    assert namespace["again"] == run and len(namespace["proxy"]) == 2
    assert samples.images.shape == (40, 1, 8, 8)


def test_the_readmes_example_runs_against_the_same_api(doc_run):
    """README.md's python block, its `steadyrl.train` answered with the docs example's run (the same call)."""
    namespace, (config, overrides, kw), _ = doc_run
    readme = re.search(r"## Python API\n.*?```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steadyrl, "train", lambda c, o=(), **k: calls.append((ROOT / c, [*o, *TINY], k)) or namespace["run"])
        names: dict = {}
        exec(compile(readme, "README.md", "exec"), names)
    assert [(c, o, k) for c, o, k in calls] == [(config, overrides[:-1], kw)]
    assert names["images"].shape == (40, 1, 8, 8) and names["run"] == namespace["run"]


def test_train_computes_the_cli_runs_metrics_evaluations_and_weights_bitwise(doc_run, cli_run):
    run, (cli_dir, _) = doc_run[0]["run"], cli_run
    cli = steadyrl.load_run(cli_dir)
    assert [r["step"] for r in run.metrics] == [1, 2]
    assert computed_metrics(run.metrics) == computed_metrics(cli.metrics)
    assert run.evaluations == cli.evaluations and [e["step"] for e in run.evaluations] == [0, 2]
    mine = load_file(str(run.last_checkpoint / "policy.safetensors"))
    theirs = load_file(str(cli.last_checkpoint / "policy.safetensors"))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # the configs differ only where the runs were told to differ
    assert run.config.model_copy(update={"run": cli.config.run}) == cli.config
    assert run.config.run.run_dir != cli.config.run.run_dir


def test_the_run_reads_its_folder(doc_run):
    run = doc_run[0]["run"]
    assert run.folder.is_absolute() and (run.folder / "config.yaml").is_file()
    assert run.config == load_config(run.folder / "config.yaml") and run.config.run.steps == 2
    assert run.checkpoints == [2] and run.last_checkpoint == run.folder / "checkpoints" / "step_2"
    assert run.metrics == [json.loads(line) for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
    assert run.evaluations == json.loads((run.folder / "evals.json").read_text())
    assert run.result.steps_done == 2 and not run.result.interrupted and run.result.exit_status == 0
    assert run.result.final_eval["held_out"] == run.evaluations[-1]["held_out"]
    assert repr(run) == f"Run({str(run.folder)!r}: digits, grpo, 2/2 steps, last checkpoint step_2)"


def test_load_run_reopens_an_equal_run_from_a_relative_path(doc_run, monkeypatch):
    run = doc_run[0]["run"]
    monkeypatch.chdir(run.folder.parent)
    again = steadyrl.load_run(run.folder.name)
    assert again == run and again.folder == run.folder and again.result is None
    assert (again.metrics, again.evaluations, again.checkpoints) == (run.metrics, run.evaluations, run.checkpoints)


def test_load_policy_holds_the_last_checkpoints_weights_tensor_by_tensor(doc_run):
    from steadyrl.rollout.policy import trainable_state

    run = doc_run[0]["run"]
    policy = run.load_policy()
    saved = load_file(str(run.last_checkpoint / "policy.safetensors"))
    state = trainable_state(policy)
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    assert not policy.training
    base = load_file(str(run.testbed.base_weights(progress=False)))
    assert any(not torch.equal(base[k], saved[k]) for k in saved)  # the two updates moved it: not the base again
    with pytest.raises(FileNotFoundError, match=r"no checkpoint step_1 in"):
        run.load_policy(step=1)


def test_sample_is_seeded_and_has_the_testbeds_shape(doc_run):
    run = doc_run[0]["run"]
    first, again, other = run.sample(3, seed=5), run.sample(3, seed=5, step=2), run.sample(3, seed=6)
    assert first.images.shape == (30, 1, 8, 8) and first.texts is None and len(first) == 30
    assert first.prompts == [c for c in range(10) for _ in range(3)]
    assert torch.equal(first.images, again.images) and torch.equal(first.images, first.batch.samples)
    assert not torch.equal(first.images, other.images)
    sevens = run.sample(2, seed=5, prompts=[7])
    assert sevens.prompts == [7, 7] and sevens.images.shape == (2, 1, 8, 8)


def test_a_language_model_run_samples_decoded_text(tmp_path):
    """An arith run folder (its checkpoint: the tiny pre-trained masked-diffusion LM): samples are the completions
    as text, of the held-out problems' prompts, greedy (one seed or another: the same text)."""
    cfg = load_config(CONFIG_DIR / "arith-grpo.yaml", ["testbed.eval_problems=4"])
    from steadyrl.services.testbeds import build_testbed

    testbed = build_testbed(cfg)
    ckpt = tmp_path / "checkpoints" / "step_0"
    ckpt.mkdir(parents=True)
    shutil.copy(testbed.base_weights(progress=False), ckpt / "policy.safetensors")
    (ckpt / "controller.json").write_text(json.dumps({"step": 0}))
    (tmp_path / "checkpoints" / "latest").write_text("step_0")
    (tmp_path / "config.yaml").write_text(dump_config(cfg))

    samples = steadyrl.load_run(tmp_path).sample(2, seed=1)
    problems = testbed.task.problems(cfg.testbed.eval_seed, range(4))
    assert samples.images is None and len(samples.texts) == 8 and all(isinstance(t, str) for t in samples.texts)
    assert samples.prompts == [p.prompt for p in problems for _ in range(2)]
    assert samples.texts == [testbed.codec.decode(row) for row in samples.batch.samples]
    assert steadyrl.load_run(tmp_path).sample(2, seed=9).texts == samples.texts  # greedy decoding


def test_progress_outside_a_terminal_is_plain_lines(doc_run, cli_run):
    for printed in (doc_run[2], cli_run[1]):  # steadyrl.train to a StringIO, steadyrl train to a pipe
        lines = [line for line in printed.splitlines() if line.startswith("RL ")]
        assert [LINE.match(line).group(1) for line in lines] == ["1", "2"], printed[-3000:]
        assert "\x1b[" not in printed and "\r" not in printed


def test_progress_lines_come_every_tenth_of_the_run_and_every_every_s_seconds():
    from steadyrl.services.driver.console import ProgressLines
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(CONFIG_DIR / "smoke.yaml", ["run.steps=100"])
    m = {"reward/train_mean": 0.5, "reward/held_out": 0.25, "policy/kl_ref_monitor": 0.0, "timing_s/step": 1.0}

    def printed(seconds_per_step: float) -> list[int]:
        out, now = io.StringIO(), [0.0]
        lines = ProgressLines(cfg, build_testbed(cfg), Console(file=out, width=200), every_s=30.0,
                              clock=lambda: now[0])
        for step in range(1, 101):
            now[0] += seconds_per_step
            lines(step, m)
        return [int(line.split()[1].split("/")[0]) for line in out.getvalue().splitlines()]

    assert printed(1.0) == [1, *range(10, 101, 10)]  # fast steps: the first, then each tenth of the run
    assert printed(31.0) == list(range(1, 101))  # steps slower than every_s: each one
    slow = printed(4.0)  # in between: never more than every_s (+ one step) without a line
    assert max(b - a for a, b in zip(slow, slow[1:])) * 4.0 <= 30.0 + 4.0 and set(range(10, 101, 10)) <= set(slow)


def test_auto_progress_is_a_live_bar_only_where_the_output_redraws():
    import importlib.util

    from steadyrl.services.driver.console import progress_style

    def terminal(term: str) -> Console:
        return Console(file=io.StringIO(), force_terminal=True, _environ={"TERM": term})

    assert progress_style("auto", Console(file=io.StringIO())) == "lines"
    assert progress_style("auto", terminal("xterm")) == "bar" and progress_style("auto", terminal("dumb")) == "lines"
    widgets = importlib.util.find_spec("ipywidgets") is not None
    assert progress_style("auto", Console(file=io.StringIO(), force_jupyter=True)) == ("bar" if widgets else "lines")
    assert progress_style("lines", Console(force_terminal=True)) == "lines"
    with pytest.raises(ValueError, match=r"progress='fancy'"):
        progress_style("fancy", Console())


def test_import_steadyrl_imports_neither_torch_nor_ray():
    code = ("import sys, steadyrl; before = sorted(m for m in ('torch', 'ray', 'rich', 'pydantic') if m in "
            "sys.modules); steadyrl.load_run; "
            "print(before, 'torch' in sys.modules, 'ray' in sys.modules, sorted(steadyrl.__all__))")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # nothing heavy at `import steadyrl`; its names then load torch, still not Ray
    assert out.stdout.split("\n")[0] == ("[] True False ['ConfigError', 'NotARunFolder', 'Run', 'RunFailed', "
                                         "'Samples', 'load_run', 'train']")


def test_the_public_names_are_where_they_live():
    from steadyrl.services.run_folder.checkpoints import RunFailed
    from steadyrl.services.run_folder.reader import NotARunFolder

    assert (steadyrl.train, steadyrl.load_run, steadyrl.Run) == (api.train, api.load_run, api.Run)
    assert (steadyrl.ConfigError, steadyrl.RunFailed, steadyrl.NotARunFolder) == (ConfigError, RunFailed, NotARunFolder)
    assert set(steadyrl.__all__) <= set(dir(steadyrl))
    with pytest.raises(AttributeError, match="has no attribute 'trian'"):
        steadyrl.trian  # noqa: B018


@pytest.mark.parametrize("kwargs, message", [
    ({"overrides": ["learner.zero_stage=7"]}, r"learner.zero_stage"),
    ({"overrides": "run.steps=2"}, r"a list of 'key.sub=value' strings"),
    ({"runtime": "gpu"}, r"runtime='gpu': one of 'ray', 'local'"),
    ({"progress": "fancy"}, r"progress='fancy': one of 'auto', 'bar', 'lines', 'none'"),
    ({"allow_changes": True}, r"allow_changes=True only applies with resume"),
    ({"config": "configs/smoke.yaml", "resume": "somewhere"}, r"with resume the config comes from the run folder"),
    ({"resume": "nowhere"}, r"resume='nowhere': no config.yaml there"),
])
def test_a_bad_call_raises_config_error_before_a_run_folder_exists(tmp_path, monkeypatch, kwargs, message):
    monkeypatch.chdir(tmp_path)
    kwargs = {"overrides": [], **kwargs}
    if isinstance(kwargs["overrides"], list):
        kwargs["overrides"] = [*kwargs["overrides"], f"run.run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=message):
        steadyrl.train(**{"runtime": "local", **kwargs})
    assert list(tmp_path.iterdir()) == []


def test_overrides_may_be_a_mapping_of_python_values():
    overrides = api.override_list({"run.steps": 7, "run.name": "true", "run.loggers": [], "run.run_dir": Path("/x"),
                                   "run.progress": False})
    cfg = load_config(CONFIG_DIR / "smoke.yaml", overrides)
    assert (cfg.run.steps, cfg.run.name, cfg.run.loggers, cfg.run.run_dir, cfg.run.progress) == (7, "true", [], "/x",
                                                                                                   False)


@pytest.mark.parametrize("make", [lambda p: p / "nope", lambda p: p], ids=["no such directory", "no config.yaml"])
def test_load_run_names_a_path_that_is_not_a_run_folder(tmp_path, make):
    path = make(tmp_path)
    with pytest.raises(steadyrl.NotARunFolder, match=re.escape(f"{path} is not a run folder")):
        steadyrl.load_run(path)


def test_resume_continues_the_run_and_none_prints_no_progress(doc_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(doc_run[0]["run"].folder, copy)
    out = io.StringIO()
    run = steadyrl.train(resume=copy, overrides=["run.steps=3"], runtime="local", progress="none",
                         console=Console(file=out, width=200))
    assert run.folder == copy and run.result.steps_done == 3 and run.checkpoints == [2, 3]
    assert [r["step"] for r in run.metrics] == [1, 2, 3]
    assert "RL " not in out.getvalue() and "run summary" not in out.getvalue()
    assert json.loads((copy / "resumes.jsonl").read_text())["changes"].keys() >= {"run.steps", "run.progress"}


def test_the_cli_train_is_a_layer_over_steadyrl_train(monkeypatch, tmp_path):
    """`steadyrl train` hands its arguments to `steadyrl.train` and exits with the returned run's status."""
    from typer.testing import CliRunner

    from steadyrl.services.driver.cli import app

    calls = []

    def fake(config, overrides, **kw):
        calls.append((config, list(overrides), kw))
        return api.Run(tmp_path, load_config(CONFIG_DIR / "smoke.yaml"), result=type("R", (), {"exit_status": 130}))

    monkeypatch.setattr(api, "train", fake)
    (tmp_path / "config.yaml").write_text("")
    result = CliRunner().invoke(app, ["train", "--local", "configs/smoke.yaml", "run.steps=3"])
    assert result.exit_code == 130, result.output
    resumed = CliRunner().invoke(app, ["train", "--resume", str(tmp_path), "--allow-changes", "run.seed=3"])
    assert resumed.exit_code == 130, resumed.output
    common = {"console": calls[0][2]["console"]}
    assert calls == [("configs/smoke.yaml", ["run.steps=3"],
                      {"runtime": "local", "resume": None, "allow_changes": False, **common}),
                     (None, ["run.seed=3"], {"runtime": None, "resume": tmp_path, "allow_changes": True, **common})]
