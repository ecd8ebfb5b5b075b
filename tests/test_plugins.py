"""Plug-in packages (rollout/plugins.py): an installed distribution's entry points add a reward kind, an objective
and a testbed that a run names like the built-ins, and a plug-in that cannot join is an error at config load.

The plug-in is docs/bring-your-own-reward.md's example, written from the page's blocks and installed with pip into
a folder that the runs (subprocesses) get on PYTHONPATH: entry points are read once per process, when steadyrl's
registries are imported, so this process (without the plug-in) is left as it is."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import SMOKE_SHORT, computed_metrics, doc_files, write_files

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "bring-your-own-reward.md"
SMOKE = ROOT / "configs" / "smoke.yaml"


def install(dist: Path, site: Path) -> Path:
    """pip-install the distribution in `dist` into the folder `site`, offline, with the venv's setuptools."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(dist)], check=True, capture_output=True, timeout=300)
    return site


def run_with(sites: list[Path], args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python ARGS` in a fresh process that has the plug-ins installed in `sites` on its PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, sites), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def python_json(sites: list[Path], code: str, cwd: Path) -> dict:
    """What a snippet run with those plug-ins prints as its last line, as JSON."""
    proc = run_with(sites, ["-c", textwrap.dedent(code)], cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    """The doc's example files (the plug-in's distribution and my_rewards.py) written into a folder."""
    return write_files(tmp_path_factory.mktemp("doc"), doc_files(DOC))


@pytest.fixture(scope="module")
def plugin(examples, tmp_path_factory) -> Path:
    """The doc's plug-in distribution (steadyrl-brightness) installed into a folder of its own."""
    assert (examples / "pyproject.toml").exists() and (examples / "steadyrl_brightness" / "rewards.py").exists()
    return install(examples, tmp_path_factory.mktemp("site"))


# ------------------------------------------------------------------------------- a run trained with the plug-in
def train(sites: list[Path], run_dir: Path, overrides: list[str], cwd: Path) -> None:
    """`steadyrl train configs/smoke.yaml --local` in a subprocess with the plug-ins in `sites`."""
    proc = run_with(sites, ["-m", "steadyrl.services.driver.cli", "train", str(SMOKE), "--local",
                            f"run.run_dir={run_dir}", *overrides], cwd)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(plugin, examples, tmp_path_factory) -> dict[str, Path]:
    """Two 2-step digits runs, each on the plug-in's brightness reward (`bright`, trained on) beside the doc's
    `kind: python` brightness function (`bright_py`): one on the plug-in testbed and objective (digits_quick,
    grpo_counted), one on the built-ins they mirror (digits, grpo)."""
    tmp = tmp_path_factory.mktemp("runs")
    rewards = (f"testbed.reward.functions=[{{kind: brightness, name: bright}}, "
               f"{{name: bright_py, function: '{examples / 'my_rewards.py'}:brightness'}}]")
    common = [*SMOKE_SHORT, "run.steps=2", "run.checkpoint_every=2", "run.eval_every=2", "ray.torch_threads=1",
              "objective.train_min_std=0.05", rewards, "testbed.reward.train_on=bright"]
    train([plugin], tmp / "plugin", ["testbed.name=digits_quick", "objective.name=grpo_counted", *common], tmp)
    train([plugin], tmp / "built_in", ["testbed.name=digits", "objective.name=grpo", *common], tmp)
    return {"plugin": tmp / "plugin", "built_in": tmp / "built_in"}


def test_a_run_on_the_plugin_testbed_and_objective_computes_what_the_built_ins_they_subclass_do(runs):
    """The plug-in testbed is digits and the plug-in objective GRPO plus one metric: the run's metrics and
    evaluations are the built-ins' bit for bit, and the plug-in objective's own metric counts its updates."""
    plugin, built_in = metrics(runs["plugin"]), metrics(runs["built_in"])
    assert [r["counted/updates"] for r in plugin] == [1.0, 2.0]
    assert not any("counted/updates" in r for r in built_in)
    assert computed_metrics([{k: v for k, v in r.items() if k != "counted/updates"} for r in plugin]) == \
        computed_metrics(built_in)
    assert json.loads((runs["plugin"] / "evals.json").read_text()) == \
        json.loads((runs["built_in"] / "evals.json").read_text())


def test_the_run_folder_records_the_plugins_by_their_names(runs):
    cfg = yaml.safe_load((runs["plugin"] / "config.yaml").read_text())
    assert cfg["testbed"]["name"] == "digits_quick" and cfg["objective"]["name"] == "grpo_counted"
    assert cfg["testbed"]["reward"]["functions"][0] == {"kind": "brightness", "name": "bright", "scale": 1.0}


def test_the_plugin_reward_is_logged_and_trained_on_and_equals_the_same_brightness_computed_by_a_function(runs):
    """`reward/bright` (the plug-in, torch on the samples) equals `reward/bright_py` (the doc's numpy function on the
    same samples as uint8 images) exactly, and is the training reward's mean."""
    for run in runs.values():
        rows = metrics(run)
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert 0 < r["reward/bright"] < 1
            assert r["reward/bright"] == r["reward/bright_py"] == r["reward/train_mean"]


# ------------------------------------------------------------------------------- the plug-in in the config
@pytest.fixture(scope="module")
def probe(plugin, tmp_path_factory) -> dict:
    """One process with the plug-in installed: the errors of unknown names, and the brightness kind in the
    text-to-image testbed's reward models (scale 2, beside JPEG) scoring a fixed batch."""
    return python_json([plugin], """
        import json, torch
        from steadyrl.reward.config import ImageRewardConfig
        from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config

        def error(override):
            try:
                load_config(CONFIG_DIR / "smoke.yaml", [override])
            except ConfigError as err:
                return str(err)

        cfg = ImageRewardConfig.model_validate({"models": [{"kind": "jpeg", "upscale": 1},
                                                           {"kind": "brightness", "name": "b", "scale": 2.0}]})
        images = torch.linspace(-1, 1, 2 * 3 * 4 * 4).reshape(2, 3, 4, 4)
        scores = cfg.ensemble_spec().build().score_all(images, ["a cat", "a dog"])
        print(json.dumps({"objective": error("objective.name=nope"), "testbed": error("testbed.name=nope"),
                          "kind": error("testbed.reward.functions=[{kind: nope, name: x}]"),
                          "names": scores.names, "b": scores.scores[:, 1].tolist()}))
    """, tmp_path_factory.mktemp("probe"))


@pytest.mark.parametrize("field,plugin_name,built_in", [("objective", "grpo_counted", "grpo"),
                                                         ("testbed", "digits_quick", "digits"),
                                                         ("kind", "brightness", "python")])
def test_an_unknown_name_is_an_error_listing_the_plugins_among_the_available_names(probe, field, plugin_name,
                                                                                    built_in):
    assert "'nope'" in probe[field] and f"'{plugin_name}'" in probe[field] and f"'{built_in}'" in probe[field]


def test_a_plugin_reward_kind_is_a_text_to_image_reward_model_beside_the_built_ins(probe):
    images = torch.linspace(-1, 1, 2 * 3 * 4 * 4).reshape(2, 3, 4, 4)
    pixels = ((images + 1) * 127.5).round().double()  # the uint8 values an image shows
    want = (2.0 * pixels.mean(dim=(1, 2, 3)) / 255).float()
    assert probe["names"] == ["jpeg_compressibility", "b"] and probe["b"] == want.tolist()


# ------------------------------------------------------------------------------- plug-ins that cannot join
BAD_PLUGIN = {
    "pyproject.toml": """\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "steadyrl-clashing"
        version = "0.1.0"

        [project.entry-points."steadyrl.rewards"]
        jpeg = "steadyrl_clashing.rewards:JpegSpec"
        brightness = "steadyrl_clashing.rewards:Brightness"
        blank = "steadyrl_clashing.rewards:blank"

        [project.entry-points."steadyrl.objectives"]
        fancy = "steadyrl_clashing.broken:Fancy"

        [project.entry-points."steadyrl.testbeds"]
        digits = "steadyrl_clashing.rewards:Digits"

        [tool.setuptools]
        packages = ["steadyrl_clashing"]
        """,
    "steadyrl_clashing/__init__.py": "",
    "steadyrl_clashing/rewards.py": """\
        def blank(images, prompts):
            return [0.0] * len(images)
        """,
    "steadyrl_clashing/broken.py": """\
        raise RuntimeError("fancy needs libfancy 2.0")
        """,
}


@pytest.fixture(scope="module")
def refusal(plugin, tmp_path_factory) -> dict:
    """A process with the doc's plug-in and steadyrl-clashing installed: steadyrl imports, a built-in reward spec
    builds, and load_config's error (Ray not imported by then)."""
    dist = write_files(tmp_path_factory.mktemp("bad"), {k: textwrap.dedent(v) for k, v in BAD_PLUGIN.items()})
    bad = install(dist, tmp_path_factory.mktemp("bad_site"))
    return python_json([plugin, bad], """
        import json, sys, torch
        from steadyrl.reward.factory import build_reward_model, parse_reward_spec
        from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config
        from steadyrl.trainer.objectives import available

        jpeg = build_reward_model(parse_reward_spec({"kind": "jpeg"})).score(torch.zeros(1, 3, 8, 8), ["x"])
        try:
            load_config(CONFIG_DIR / "smoke.yaml")
            error = None
        except ConfigError as err:
            error = str(err)
        print(json.dumps({"jpeg": jpeg.tolist(), "error": error, "ray": "ray" in sys.modules,
                          "objectives": available()}))
    """, tmp_path_factory.mktemp("refusal"))


def test_a_plugin_named_like_a_built_in_is_an_error_at_config_load_naming_its_distribution_and_entry_point(refusal):
    assert refusal["error"].startswith("plug-in packages:")
    assert ("plug-in reward kind 'jpeg' from steadyrl-clashing (entry point steadyrl.rewards:jpeg -> "
            "steadyrl_clashing.rewards:JpegSpec) clashes with a built-in reward kind") in refusal["error"]
    assert ("plug-in testbed 'digits' from steadyrl-clashing (entry point steadyrl.testbeds:digits -> "
            "steadyrl_clashing.rewards:Digits) clashes with a built-in testbed") in refusal["error"]
    assert not refusal["ray"]  # raised before anything started


def test_two_plugins_offering_one_name_is_an_error_naming_both(refusal):
    assert ("plug-in reward kind 'brightness' is offered by more than one plug-in: ") in refusal["error"]
    assert "steadyrl-brightness (entry point steadyrl.rewards:brightness -> steadyrl_brightness.rewards:" \
           "BrightnessSpec)" in refusal["error"]
    assert "steadyrl-clashing (entry point steadyrl.rewards:brightness -> steadyrl_clashing.rewards:Brightness)" \
        in refusal["error"]


def test_a_plugin_that_fails_to_import_is_an_error_naming_its_entry_point_with_its_own_message(refusal):
    assert ("plug-in objective 'fancy' from steadyrl-clashing (entry point steadyrl.objectives:fancy -> "
            "steadyrl_clashing.broken:Fancy) failed to import: RuntimeError: fancy needs libfancy 2.0") \
        in refusal["error"]


def test_an_entry_point_naming_something_its_group_cannot_use_is_an_error_saying_what_it_is(refusal):
    assert ("plug-in reward kind 'blank' from steadyrl-clashing (entry point steadyrl.rewards:blank -> "
            "steadyrl_clashing.rewards:blank): function blank is not a reward spec") in refusal["error"]


def test_plugins_that_cannot_join_leave_steadyrl_and_the_other_plugins_working(refusal):
    """The broken ones are left out at import, the rest is whole: a built-in reward builds and scores, and the
    doc's plug-in objective (no clash) is registered."""
    assert len(refusal["jpeg"]) == 1 and refusal["jpeg"][0] < 0  # -(size in kB)
    assert "grpo_counted" in refusal["objectives"] and "fancy" not in refusal["objectives"]
