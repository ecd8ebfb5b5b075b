"""`steadyrl export`'s own rules (services/driver/export.py), on a real two-step digits run: a run folder, a step or
an OUT it cannot use is an error naming it with nothing written; the export is whole or absent (a testbed export
that fails midway leaves no OUT and no hidden partial folder, and an old OUT untouched); the model card's front
matter, evaluation table and command line; and `--push-to-hub`, which only runs when asked, refuses offline
before any connection, and leaves the exported folder complete.

What a testbed writes (`Testbed.export`) is each testbed's own test (tests/test_export_*.py). Here, where an export
has to succeed or fail, the digits testbed's `export` is replaced by one that writes a file (and fails when the
test says): what is tested is the driver around it."""
from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from steadyrl.services.config import CONFIG_DIR
from steadyrl.services.driver import export as export_module
from steadyrl.services.driver.cli import app
from steadyrl.services.run_folder.model_card import ExportInfo
from steadyrl.services.testbeds.digits.testbed import DigitsTestbed
from tests.helpers import train_local

ROOT = Path(__file__).resolve().parents[1]
# two steps, a checkpoint and an evaluation at step 2, tiny evaluations, one torch thread
TINY = ["run.steps=2", "run.checkpoint_every=2", "run.eval_every=2", "sampler.group_size=4",
        "testbed.eval_samples_per_class=2", "ray.torch_threads=1"]
INFO = ExportInfo(format="a stand-in's weights file", library="diffusers", base_model="steadyrl/digits-unet",
                  load="open('{path}/weights.bin').read()", tags=("stand-in",))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    result, _ = train_local(CONFIG_DIR / "smoke.yaml", tmp_path_factory.mktemp("export") / "run", TINY)
    return Path(result.run_dir)


def leftovers(folder: Path) -> list[str]:
    """Hidden partial or old folders an export leaves beside OUT."""
    return sorted(p.name for p in folder.iterdir() if re.match(r"\..*\.(partial|old)-\d+", p.name))


def export(monkeypatch, *args: str):
    """`steadyrl export ARGS` through the CLI, with sys.argv as a shell would give it (the model card records it)."""
    argv = ["steadyrl", "export", *args]
    monkeypatch.setattr(sys, "argv", argv)
    return CliRunner().invoke(app, argv[1:])


@pytest.fixture
def stand_in(monkeypatch):
    """The digits testbed's export replaced by one that writes weights.bin (and fails after it when told)."""
    calls = {"fail": False, "n": 0}

    def write(self, policy, out, merge=False):
        calls["n"] += 1
        (Path(out) / "weights.bin").write_text(f"{type(policy).__name__} merge={merge}")
        if calls["fail"]:
            raise RuntimeError("the testbed's export failed midway")
        return INFO

    monkeypatch.setattr(DigitsTestbed, "export", write)
    return calls


@pytest.fixture
def hub(monkeypatch):
    """huggingface_hub's HfApi replaced by one that records its calls (no network here)."""
    import huggingface_hub

    calls: list = []

    class Recorder:
        fail: Exception | None = None

        def __init__(self, *a, **kw):
            calls.append(("HfApi", a, kw))

        def create_repo(self, *a, **kw):
            calls.append(("create_repo", a, kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", (), kw))
            if Recorder.fail is not None:
                raise Recorder.fail
            return f"https://huggingface.co/{kw['repo_id']}/commit/0123"

    monkeypatch.setattr(huggingface_hub, "HfApi", Recorder)
    return calls, Recorder


# ---------------------------------------------------------------------------------------- what it refuses
def test_a_folder_without_config_yaml_is_refused_naming_it_and_nothing_is_written(monkeypatch, tmp_path, stand_in):
    folder = tmp_path / "not-a-run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("")
    out = tmp_path / "out"
    result = export(monkeypatch, str(folder), str(out))
    assert result.exit_code == 2 and f"{folder} is not a run folder (no config.yaml" in result.output, result.output
    assert not out.exists() and leftovers(tmp_path) == [] and stand_in["n"] == 0


def test_a_run_without_checkpoints_is_refused_naming_it(monkeypatch, tmp_path, run, stand_in):
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("checkpoints"))
    out = tmp_path / "out"
    result = export(monkeypatch, str(bare), str(out))
    assert result.exit_code == 2 and f"{bare} has no checkpoints" in result.output, result.output
    assert not out.exists() and leftovers(tmp_path) == [] and stand_in["n"] == 0


def test_a_step_without_a_checkpoint_is_refused_listing_the_steps_there(monkeypatch, tmp_path, run, stand_in):
    out = tmp_path / "out"
    result = export(monkeypatch, str(run), str(out), "--step", "1")
    assert result.exit_code == 2, result.output
    assert f"--step 1: {run} has no checkpoint of that step; it has steps [2]" in result.output.replace("\n", "")
    assert not out.exists() and leftovers(tmp_path) == [] and stand_in["n"] == 0


@pytest.mark.parametrize("kind", ["a non-empty folder", "a file"])
def test_an_out_that_is_a_non_empty_folder_or_a_file_is_refused_and_left_as_it_was(monkeypatch, tmp_path, run,
                                                                                  stand_in, kind):
    out = tmp_path / "out"
    if kind == "a file":
        out.write_text("mine")
        expected = f"{out} exists and is not a folder"
    else:
        out.mkdir()
        (out / "mine.txt").write_text("mine")
        expected = f"{out} is not empty: choose a new folder, or pass --overwrite"
    result = export(monkeypatch, str(run), str(out))
    assert result.exit_code == 2 and expected in result.output.replace("\n", ""), result.output
    assert (out.read_text() if kind == "a file" else sorted(p.name for p in out.iterdir())) == \
        ("mine" if kind == "a file" else ["mine.txt"])
    assert leftovers(tmp_path) == [] and stand_in["n"] == 0


# ---------------------------------------------------------------------------------------- whole or absent
def test_an_export_that_fails_midway_leaves_no_out_and_no_partial_folder(tmp_path, run, stand_in):
    stand_in["fail"] = True
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="failed midway"):
        export_module.export_run(run, out)
    assert stand_in["n"] == 1  # it ran, wrote its file, and failed
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_with_overwrite_a_failing_export_leaves_the_old_out_untouched(tmp_path, run, stand_in):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("the previous export")
    stand_in["fail"] = True
    with pytest.raises(RuntimeError, match="failed midway"):
        export_module.export_run(run, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"] and (out / "old.txt").read_text() == \
        "the previous export"
    assert leftovers(tmp_path) == []


def test_with_overwrite_a_complete_export_replaces_the_old_out(tmp_path, run, stand_in):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("the previous export")
    folder, info = export_module.export_run(run, out, overwrite=True)
    assert folder == out.absolute() and info == INFO
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "weights.bin"] and leftovers(tmp_path) == []


def test_an_empty_out_folder_is_used(tmp_path, run, stand_in):
    out = tmp_path / "out"
    out.mkdir()
    export_module.export_run(run, out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "weights.bin"] and leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------- the model card
def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_the_model_card_has_yaml_front_matter_the_evaluation_and_the_command(monkeypatch, tmp_path, run, stand_in):
    out = tmp_path / "model"
    result = export(monkeypatch, str(run), str(out), "--step", "2")
    assert result.exit_code == 0, result.output
    assert f"{out.absolute()}: {INFO.format}" in result.output.replace("\n", "")
    assert f"open('{out.absolute()}/weights.bin').read()" in result.output.replace("\n", "")
    card = (out / "README.md").read_text()
    front = front_matter(card)
    assert front["base_model"] == "steadyrl/digits-unet" and front["library_name"] == "diffusers"
    assert front["tags"][:4] == ["steadyrl", "reinforcement-learning", "grpo", "digits"] and "stand-in" in front["tags"]
    evals = json.loads((run / "evals.json").read_text())
    base, final = evals[0], next(e for e in evals if e["step"] == 2)
    assert base["step"] == 0
    table = card.split("## Evaluation", 1)[1].split("##", 1)[0]
    assert "| figure | base (step 0) | step 2 |" in table
    for key in ("held_out", "proxy_mean", "diversity_nn"):
        assert f"| {key} | {base[key]:.4g} | {final[key]:.4g} |" in table
    assert "open('path/to/this/folder/weights.bin').read()" in card
    made_by = card.split("## Made by", 1)[1]
    assert f"steadyrl export {run} {out} --step 2" in made_by


def test_a_card_without_the_steps_evaluation_says_so(tmp_path, run):
    from steadyrl.services.config import load_config
    from steadyrl.services.run_folder.model_card import model_card

    evals = json.loads((run / "evals.json").read_text())
    card = model_card(load_config(run / "config.yaml"), evals, 1, INFO, "steadyrl export x y")
    assert "No evaluation at this step." in card and front_matter(card)["library_name"] == "diffusers"
    self_contained = model_card(load_config(run / "config.yaml"), evals, 2,
                                ExportInfo("whole", "diffusers", "load('{path}')"), "c")
    assert "base_model" not in front_matter(self_contained)


# ---------------------------------------------------------------------------------------- --push-to-hub
def test_without_push_to_hub_nothing_is_pushed(monkeypatch, tmp_path, run, stand_in, hub):
    calls, _ = hub
    pushed: list = []
    monkeypatch.setattr(export_module, "push_to_hub", lambda *a: pushed.append(a))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    result = export(monkeypatch, str(run), str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert calls == [] and pushed == [] and "pushed" not in result.output


def test_export_imports_huggingface_hub_only_to_push():
    tree = ast.parse((ROOT / "services/driver/export.py").read_text())
    importers = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 and "huggingface_hub" in ((node.module or "") if isinstance(node, ast.ImportFrom)
                                           else " ".join(a.name for a in node.names))]
    push = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "push_to_hub")
    assert importers and all(any(n is i for n in ast.walk(push)) for i in importers)


def test_push_to_hub_offline_says_it_needs_the_network_and_the_export_is_complete(monkeypatch, tmp_path, run,
                                                                                  stand_in, hub):
    calls, _ = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what the CLI sets unless told otherwise
    out = tmp_path / "out"
    result = export(monkeypatch, str(run), str(out), "--push-to-hub", "me/digits-grpo")
    said = result.output.replace("\n", "")
    assert result.exit_code == 2, result.output
    assert "--push-to-hub me/digits-grpo needs the network, and HF_HUB_OFFLINE=1 is set" in said
    assert "HF_HUB_OFFLINE=0" in said and f"hf upload me/digits-grpo {out.absolute()}" in said
    assert f"{out.absolute()} is complete" in said
    assert calls == []  # refused before huggingface_hub was asked for anything
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "weights.bin"] and leftovers(tmp_path) == []


def test_push_to_hub_creates_the_repo_then_uploads_the_exported_folder(monkeypatch, tmp_path, run, stand_in, hub):
    calls, _ = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    out = tmp_path / "out"
    result = export(monkeypatch, str(run), str(out), "--push-to-hub", "me/digits-grpo")
    assert result.exit_code == 0, result.output
    assert [c[0] for c in calls] == ["HfApi", "create_repo", "upload_folder"]
    assert calls[1][1:] == (("me/digits-grpo",), {"repo_type": "model", "exist_ok": True})
    upload = calls[2][2]
    assert (upload["folder_path"], upload["repo_id"], upload["repo_type"]) == (str(out.absolute()), "me/digits-grpo",
                                                                                "model")
    assert "pushed to https://huggingface.co/me/digits-grpo/commit/0123" in result.output


def test_a_failed_upload_names_the_repo_and_leaves_the_export_complete(monkeypatch, tmp_path, run, stand_in, hub):
    _, recorder = hub
    recorder.fail = PermissionError("401 Unauthorized: no token")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    out = tmp_path / "out"
    result = export(monkeypatch, str(run), str(out), "--push-to-hub", "me/digits-grpo")
    said = result.output.replace("\n", "")
    assert result.exit_code == 2, result.output
    assert "--push-to-hub me/digits-grpo: the upload failed (PermissionError: 401 Unauthorized: no token)" in said
    assert f"hf upload me/digits-grpo {out.absolute()}" in said
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "weights.bin"]
