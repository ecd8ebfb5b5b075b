"""`steadyrl sample RUN_DIR OUT`: a checkpoint's seeded samples written to look at, through `Run.sample(...).save`.
Each run folder here holds one checkpoint, the testbed's pre-trained base (what a run checkpoints before its first
update). Digits: a PNG grid with a row per prompt and K columns, the same pixels for the same seed, the file
`run.sample(...).save` writes; arith: a text file listing each prompt with its K completions,
`run.sample(...).texts`; text-to-image (a tiny SD pipeline): a prompt of neither split samples too. Prompts come from a .txt / .jsonl file or the command line; a prompt, prompts file, run folder, step
or OUT that cannot be used is an error naming it, with nothing written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import steadyrl
from steadyrl.services.config import CONFIG_DIR, dump_config, load_config
from steadyrl.services.driver.cli import app
from steadyrl.services.run_folder.figures import GRID_DPI, grid_figsize
from steadyrl.services.testbeds import build_testbed
from steadyrl.services.testbeds.base import PromptError


def sample(*args: str):
    return CliRunner().invoke(app, ["sample", *map(str, args)])


def said(result) -> str:
    return result.output.replace("\n", "")


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def base_checkpoint_run(folder: Path, cfg) -> Path:
    """A run folder whose one checkpoint (step 0) holds the testbed's pre-trained base: what `steadyrl train`
    writes there before its first update."""
    ckpt = folder / "checkpoints" / "step_0"
    ckpt.mkdir(parents=True)
    shutil.copy(build_testbed(cfg).base_weights(progress=False), ckpt / "policy.safetensors")
    (ckpt / "controller.json").write_text(json.dumps({"step": 0}))
    (folder / "checkpoints" / "latest").write_text("step_0")
    (folder / "config.yaml").write_text(dump_config(cfg))
    return folder


def bare_run(run: Path, where: Path) -> Path:
    """A copy of a run folder without its checkpoints."""
    shutil.copytree(run, where, ignore=shutil.ignore_patterns("checkpoints"))
    return where


# ---------------------------------------------------------------------------------------------- digits
@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    return base_checkpoint_run(tmp_path_factory.mktemp("digits") / "run", load_config(CONFIG_DIR / "smoke.yaml"))


def test_the_grid_has_a_row_per_prompt_and_k_columns(digits_run, tmp_path):
    for prompts, n in (("0,3,7", 3), ("5", 5)):
        out = tmp_path / f"{n}.png"
        result = sample(digits_run, out, "--prompts", prompts, "--n", n, "--seed", 1)
        assert result.exit_code == 0, result.output
        rows = prompts.split(",")
        assert f"{out}: {len(rows) * n} samples ({n} of each of {len(rows)} prompts)" in said(result)
        w, h = grid_figsize(len(rows), n, 8, rows)
        assert Image.open(out).size == (round(w * GRID_DPI), round(h * GRID_DPI))
    assert Image.open(tmp_path / "5.png").size[0] > Image.open(tmp_path / "3.png").size[0]  # more columns
    assert Image.open(tmp_path / "5.png").size[1] < Image.open(tmp_path / "3.png").size[1]  # fewer rows


def test_the_same_seed_gives_the_same_grid_and_another_seed_another(digits_run, tmp_path):
    for name, seed in (("a", 2), ("b", 2), ("c", 3)):
        assert sample(digits_run, tmp_path / f"{name}.png", "--prompts", "1,4", "--n", 3, "--seed", seed).exit_code == 0
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert not np.array_equal(pixels(tmp_path / "a.png"), pixels(tmp_path / "c.png"))


def test_the_command_writes_what_run_sample_save_writes(digits_run, tmp_path):
    result = sample(digits_run, tmp_path / "cli.png", "--prompts", "0,3,7", "--n", 3, "--seed", 1)
    assert result.exit_code == 0, result.output
    samples = steadyrl.load_run(digits_run).sample(3, seed=1, prompts="0,3,7")
    assert samples.prompts == [0, 0, 0, 3, 3, 3, 7, 7, 7] and samples.images.shape == (9, 1, 8, 8)
    assert samples.save(tmp_path / "api.png") == tmp_path / "api.png"
    assert (tmp_path / "api.png").read_bytes() == (tmp_path / "cli.png").read_bytes()
    same = steadyrl.load_run(digits_run).sample(3, seed=1, prompts=[0, 3, 7])  # class ids as numbers: the same
    assert torch.equal(same.images, samples.images)


def test_prompts_come_from_a_txt_or_jsonl_file_and_out_may_be_a_folder(digits_run, tmp_path):
    (tmp_path / "p.txt").write_text("# two rows\n3\n\n0, 1\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "3"}\n{"prompt": "0,1"}\n')
    for name in ("p.txt", "p.jsonl"):
        out = tmp_path / name.replace(".", "_")
        result = sample(digits_run, out, "--prompts", tmp_path / name, "--n", 2)
        assert result.exit_code == 0, result.output
        assert sorted(p.name for p in out.iterdir()) == ["samples_step_0.png"]
    assert (tmp_path / "p_txt" / "samples_step_0.png").read_bytes() == \
        (tmp_path / "p_jsonl" / "samples_step_0.png").read_bytes()
    expected = steadyrl.load_run(digits_run).sample(2, prompts=["3", "0, 1"]).save(tmp_path / "x.png")
    assert expected.read_bytes() == (tmp_path / "p_txt" / "samples_step_0.png").read_bytes()


def test_fewer_denoising_steps_sample_other_images(digits_run, tmp_path):
    run = steadyrl.load_run(digits_run)
    assert run.config.sampler.num_steps != 4
    fewer, default = run.sample(2, seed=0, prompts="3", steps=4), run.sample(2, seed=0, prompts="3")
    assert not torch.equal(fewer.images, default.images) and "4 steps" in fewer.title
    result = sample(digits_run, tmp_path / "s.png", "--prompts", "3", "--n", 2, "--steps", 4)
    assert result.exit_code == 0, result.output
    assert fewer.save(tmp_path / "api.png").read_bytes() == (tmp_path / "s.png").read_bytes()


@pytest.mark.parametrize("case", ["class 12", "not a class", "missing file", "malformed jsonl", "undecodable file",
                                  "no checkpoints", "no such step", "not a run folder", "a .txt for images",
                                  "another suffix", "steps the sampler refuses"])
def test_what_cannot_be_used_is_an_error_naming_it_and_nothing_is_written(digits_run, tmp_path, case):
    out, run, extra = tmp_path / "out" / "grid.png", digits_run, []
    prompts = "3"
    if case == "class 12":
        prompts, expected = "0,12", "prompt '0,12': digits' prompts are class ids 0-9 (\"3\", \"0,1,2\"); not '12'"
    elif case == "not a class":
        prompts, expected = "seven", "prompt 'seven': digits' prompts are class ids 0-9"
    elif case == "missing file":
        prompts, expected = str(tmp_path / "nope.txt"), f"--prompts {tmp_path / 'nope.txt'}: no such prompts file"
    elif case == "malformed jsonl":
        (tmp_path / "bad.jsonl").write_text('{"prompt": "3"}\n{"text": "4"}\n')
        prompts, expected = str(tmp_path / "bad.jsonl"), "bad.jsonl, line 2: missing the required \"prompt\" key"
    elif case == "undecodable file":
        (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\xfa3\n")
        prompts, expected = str(tmp_path / "bin.txt"), f"--prompts {tmp_path / 'bin.txt'}: cannot read the prompts file"
    elif case == "no checkpoints":
        run = bare_run(digits_run, tmp_path / "bare")
        expected = f"{run} has no checkpoints (checkpoints/step_N)"
    elif case == "no such step":
        extra, expected = ["--step", "1"], f"--step 1: {run} has no checkpoint of that step; it has steps [0]"
    elif case == "not a run folder":
        run, expected = tmp_path, f"{tmp_path} is not a run folder (no config.yaml"
    elif case == "a .txt for images":
        out, expected = tmp_path / "out" / "s.txt", f"{tmp_path / 'out' / 's.txt'}: these samples are images, " \
                                                    "written as a .png file (or give a folder)"
    elif case == "another suffix":
        out, expected = tmp_path / "out" / "s.jpg", f"{tmp_path / 'out' / 's.jpg'}: samples are written as a .png " \
                                                    "or .txt file, or into a folder"
    else:
        extra, expected = ["--steps", "1"], "sampler.num_steps"
    result = sample(run, out, "--prompts", prompts, *extra)
    assert result.exit_code == 2 and "error:" in result.output, result.output
    assert expected in said(result), result.output
    assert not (tmp_path / "out").exists()


def test_the_python_api_raises_a_prompt_error_naming_the_prompt(digits_run):
    run = steadyrl.load_run(digits_run)
    with pytest.raises(PromptError, match=r"prompt '12'"):
        run.sample(1, prompts="12")
    with pytest.raises(PromptError, match=r"all ids or all text"):
        run.sample(1, prompts=[3, "4"])
    with pytest.raises(ValueError, match=r"n=0"):
        run.sample(0)


# ---------------------------------------------------------------------------------------------- arith
@pytest.fixture(scope="module")
def arith_run(tmp_path_factory) -> Path:
    cfg = load_config(CONFIG_DIR / "arith-grpo.yaml", ["testbed.eval_problems=4"])
    return base_checkpoint_run(tmp_path_factory.mktemp("arith") / "run", cfg)


def test_a_language_models_samples_are_each_prompt_then_its_completions(arith_run, tmp_path):
    (tmp_path / "problems.txt").write_text("07+45=\n31+19=\n")
    out = tmp_path / "completions.txt"
    result = sample(arith_run, out, "--prompts", tmp_path / "problems.txt", "--n", 2, "--seed", 4)
    assert result.exit_code == 0, result.output
    samples = steadyrl.load_run(arith_run).sample(2, seed=4, prompts=["07+45=", "31+19="])
    assert samples.prompts == ["07+45=", "07+45=", "31+19=", "31+19="] and len(samples.texts) == 4
    t = samples.texts
    assert out.read_text() == (f"# run step_0, seed 4, 2 per prompt\n\n07+45=\n  [1] {t[0]}\n  [2] {t[1]}\n\n"
                               f"31+19=\n  [1] {t[2]}\n  [2] {t[3]}\n")
    assert samples.save(tmp_path / "api.txt").read_text() == out.read_text()
    folder = sample(arith_run, tmp_path / "dir", "--prompts", "07+45=", "--n", 2, "--seed", 4)
    assert folder.exit_code == 0 and (tmp_path / "dir" / "samples_step_0.txt").read_text().split("\n")[2:5] == \
        ["07+45=", f"  [1] {t[0]}", f"  [2] {t[1]}"]


def test_the_held_out_problems_are_the_default_prompts(arith_run, tmp_path):
    result = sample(arith_run, tmp_path / "held_out.txt", "--n", 1)
    assert result.exit_code == 0, result.output
    run = steadyrl.load_run(arith_run)
    problems = run.testbed.task.problems(run.config.testbed.eval_seed, range(4))
    lines = (tmp_path / "held_out.txt").read_text().split("\n")
    assert [lines[2 + 3 * i] for i in range(4)] == [p.prompt for p in problems]


@pytest.mark.parametrize("prompt, expected", [
    ("07+4a=", "prompt '07+4a=' cannot be encoded: characters ['a'] are not in the arith vocabulary"),
    ("1" * 60 + "=", "tokens: with sampler.gen_length="),
])
def test_a_problem_the_tokenizer_or_model_cannot_take_is_named(arith_run, tmp_path, prompt, expected):
    result = sample(arith_run, tmp_path / "out.txt", "--prompts", prompt)
    assert result.exit_code == 2 and expected in said(result), result.output
    assert not (tmp_path / "out.txt").exists()


# ---------------------------------------------------------------------------------------------- text-to-image
@pytest.fixture(scope="module")
def t2i_run(tmp_path_factory) -> Path:
    from tests.tiny_models import save_tiny_sd_pipeline

    root = tmp_path_factory.mktemp("t2i")
    pipeline = save_tiny_sd_pipeline(root / "sd")
    cfg = load_config(None, ["testbed.name=text_to_image", f"testbed.pretrained={pipeline}",
                             "testbed.prompts.train=tiny", "testbed.prompts.prompts_per_step=2", "sampler.kind=ddim",
                             "sampler.num_steps=4", "sampler.group_size=3"])
    return base_checkpoint_run(root / "run", cfg)


def test_text_to_image_samples_prompts_of_neither_split_in_labelled_rows(t2i_run, tmp_path):
    out = tmp_path / "grid.png"
    result = sample(t2i_run, out, "--prompts", "a purple cube on a table", "--n", 2)
    assert result.exit_code == 0, result.output
    run = steadyrl.load_run(t2i_run)
    samples = run.sample(2, prompts=["a purple cube on a table", "cat"])
    assert samples.prompts == ["a purple cube on a table"] * 2 + ["cat"] * 2
    assert samples.images.shape[:2] == (4, 3)
    first = run.sample(2, prompts="a purple cube on a table")
    assert first.save(tmp_path / "api.png").read_bytes() == out.read_bytes()
    ids = run.testbed.prompts_from_text(["cat", "a purple cube on a table"])
    assert run.testbed.prompt_texts(ids) == ["cat", "a purple cube on a table"]
