"""docs/bring-your-own-reward.md's examples as a user types them: the page's files written as printed, `steadyrl
train` run on them from the command line (local runtime, a short run, in the folder that holds them), and what each
reward logs checked against the same computation done here. (Its plug-in package: tests/test_plugins.py.)"""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from steadyrl.reward.factory import build_reward_model
from steadyrl.reward.python_reward import resolve
from steadyrl.services.config import load_config
from steadyrl.services.run_folder.metrics import read_metrics
from tests.helpers import doc_files, free_port, wait_for, write_files

DOC = Path(__file__).resolve().parents[1] / "docs" / "bring-your-own-reward.md"
SHORT = ["run.steps=2", "run.eval_every=2", "run.checkpoint_every=2", "sampler.group_size=4",
         "testbed.eval_samples_per_class=2", "run.progress=false", "ray.torch_threads=1"]


@pytest.fixture
def examples(tmp_path) -> Path:
    return write_files(tmp_path, doc_files(DOC))


def steadyrl_train(folder: Path, config: str) -> list[dict]:
    """`steadyrl train CONFIG --local` in `folder`, as a user types it (plus a short run's overrides)."""
    cli = Path(sys.executable).parent / "steadyrl"
    done = subprocess.run([str(cli), "train", config, "--local", "run.run_dir=run", *SHORT], cwd=folder,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_metrics(folder / "run")


@pytest.mark.slow
def test_the_pages_function_in_15_lines_trains_a_digits_run_from_the_command_line(examples):
    """my_rewards.py and my-run.yaml as printed: both columns are logged each step; a group's ranks are a
    permutation of 0, 1/3, 2/3, 1, so `rank` averages exactly 0.5; `brightness` is the mean level / 255."""
    lines = len((examples / "my_rewards.py").read_text().strip().splitlines())
    assert lines <= 15, f"the page's 'function in 15 lines' has {lines}"
    rows = steadyrl_train(examples, "my-run.yaml")
    assert [r["reward/rank"] for r in rows] == [0.5, 0.5]
    assert all(0 < r["reward/bright"] < 1 for r in rows)
    brightness = resolve(f"{examples / 'my_rewards.py'}:brightness")
    image = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    assert brightness([image], [3], scale=2.0) == [2.0 * 23.5 / 255]


@pytest.mark.slow
def test_the_pages_remote_scorer_serves_and_trains_as_its_server_computes(examples):
    """scorer_server.py served by uvicorn as the page says (on a free port instead of 8765) and remote.yaml
    trained on: its column is logged, and the scores of the spec as loaded from remote.yaml are the server's
    formula (std of the grey levels / 127.5) on the JPEG the protocol sends, computed here."""
    port = free_port()
    config = examples / "remote.yaml"
    config.write_text(config.read_text().replace("8765", str(port)))
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "scorer_server:app", "--host", "127.0.0.1",
                               "--port", str(port)], cwd=examples, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/score", timeout=2).status_code == 405
            except httpx.TransportError:
                return False

        wait_for(up, "the page's scorer server", timeout_s=60)
        rows = steadyrl_train(examples, "remote.yaml")
        assert all(0 < r["reward/remote_contrast"] < 1 for r in rows)
        spec = next(f for f in load_config(config).testbed.reward.functions if f.name == "remote_contrast")
        x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
        got = build_reward_model(spec).score(x, torch.arange(5))
    finally:
        server.terminate()
        server.wait(timeout=30)
    want = []
    for img in ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)[:, 0].numpy():
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG")
        want.append(float(np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("L"), dtype=np.float64).std())
                    / 127.5)
    assert got.tolist() == torch.tensor(want, dtype=torch.float32).tolist()
