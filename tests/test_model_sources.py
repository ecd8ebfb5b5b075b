"""A model that cannot be had (no directory, not in the Hugging Face cache, the hub offline or unreachable) fails
before anything starts: a few lines naming the setting, the id and how to provide it, exit status 2, no traceback,
no run folder, Ray never imported (rollout/model_sources.py, `Testbed.require_models`).

huggingface_hub reads HF_HOME, HF_HUB_OFFLINE and HF_ENDPOINT when it is imported, so the cases that depend on them
run in a subprocess with their own environment. Every endpoint is on 127.0.0.1: a closed port, or a fake hub
served here; nothing else is contacted."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from steadyrl.rollout.model_sources import source_problem
from steadyrl.services.config import CONFIG_DIR, ConfigError

ROOT = Path(__file__).resolve().parents[1]
STEADYRL = [sys.executable, "-m", "steadyrl.services.driver.cli"]
SD35 = "stabilityai/stable-diffusion-3.5-medium"
CHECK = """import json, sys
from steadyrl.rollout.model_sources import ModelsUnavailable, check_model_sources
try:
    check_model_sources([tuple(s) for s in json.loads(sys.argv[1])])
    print(json.dumps({"problems": [], "message": ""}))
except ModelsUnavailable as err:
    print(json.dumps({"problems": err.problems, "message": str(err)}))
"""


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_env(tmp_path: Path, endpoint: str | None = None, **extra: str) -> dict[str, str]:
    """This environment with an empty Hugging Face home under `tmp_path`, the hub at `endpoint` (default: a closed
    port on 127.0.0.1, so that nothing leaves this machine even online), no token, no proxy, and the offline switches
    unset (the CLI's default applies) unless `extra` sets them."""
    drop = ("HF_", "HUGGINGFACE", "TRANSFORMERS_OFFLINE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(drop)}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": endpoint or f"http://127.0.0.1:{closed_port()}",
            "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1,localhost", **extra}


def fake_cached_repo(hub_cache: Path, repo_id: str, commit: str = "0" * 40) -> Path:
    """`repo_id` in a hub cache as huggingface_hub lays it out: models--org--name/ with refs/main naming the commit,
    blobs/<hash> holding the file and snapshots/<commit>/config.json a link to it."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "a1b2c3").write_text('{"model_type": "clip"}')
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(Path("..", "..", "blobs", "a1b2c3"))
    return snapshot


def check_in_subprocess(sources: list[tuple[str, str]], env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHECK, json.dumps(sources)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def steadyrl(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`steadyrl ARGS` in `tmp_path` with an empty Hugging Face cache: (exit status, stdout + stderr)."""
    out = subprocess.run([*STEADYRL, *args], env=env or hf_env(tmp_path), cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


def assert_short_error(status: int, text: str, *named: str) -> None:
    assert status == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) <= 8, text
    assert text.startswith("error:") and "huggingface-cli download" in text and "hf download" in text, text
    for name in named:
        assert name in text, (name, text)


# ---------------------------------------------------------------------------------------------- the checker
def test_an_existing_directory_is_available_without_asking_the_hub(tmp_path):
    assert source_problem(str(tmp_path)) is None


@pytest.mark.parametrize("path", ["/no/such/model", "./no-such-model", "../no-such-model", "~/no-such-model-dir"])
def test_a_missing_path_is_no_such_directory(path):
    assert source_problem(path) == "no such directory"


def test_an_empty_source_is_not_this_directory():
    assert source_problem(" ") == source_problem("") == "is empty (a directory or a hub id is needed)"


def test_a_file_is_not_a_model_directory(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert source_problem(str(tmp_path / "model.safetensors")) == "is a file, not a model directory"


def test_offline_a_cached_hub_id_passes_and_an_absent_one_fails_naming_its_setting(tmp_path):
    fake_cached_repo(tmp_path / "hf" / "hub", "org/cached-model")
    result = check_in_subprocess([("testbed.pretrained", "org/cached-model"),
                                  ("testbed.reward.models[0].model", "org/absent-model"),
                                  ("testbed.reward.models[1].model", "not/a/hub/id")],
                                 hf_env(tmp_path, HF_HUB_OFFLINE="1"))
    assert result["problems"] == [
        ["testbed.reward.models[0].model", "org/absent-model", "not in the local Hugging Face cache, and no such "
         "directory"],
        ["testbed.reward.models[1].model", "not/a/hub/id", "no such directory, and not a hub id (namespace/name)"]]
    message = result["message"]
    assert "2 models cannot be loaded" in message and "org/cached-model" not in message
    assert "testbed.reward.models[0].model=/path/to/local/copy" in message  # the first failing setting as example
    assert str(tmp_path / "hf" / "hub") in message and "set HF_HUB_OFFLINE=0 to let it download" in message


def test_online_an_unreachable_hub_fails_at_once_with_the_connection_reason(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    t0 = time.perf_counter()
    result = check_in_subprocess([("testbed.pretrained", "org/absent-model")],
                                 hf_env(tmp_path, endpoint, HF_HUB_OFFLINE="0"))
    assert time.perf_counter() - t0 < 30
    [(setting, source, why)] = result["problems"]
    assert (setting, source) == ("testbed.pretrained", "org/absent-model")
    assert f"the hub ({endpoint}) cannot be asked" in why and "Connect" in why and "refused" in why.lower(), why
    assert "\n" not in why and "HF_HUB_OFFLINE=0 to let it download" not in result["message"]  # it was online


class FakeHub(BaseHTTPRequestHandler):
    """The hub's model API for three repos: org/open (served), org/gated (gated, this user has no access), and
    any other (not found), answering with the headers huggingface_hub turns into its errors."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.startswith("/api/models/org/open"):
            self._answer(200, {"id": "org/open", "gated": False})
        elif self.path.startswith("/api/models/org/gated/auth-check"):
            self._answer(403, {"error": "gated"}, {"X-Error-Code": "GatedRepo"})
        elif self.path.startswith("/api/models/org/gated"):
            self._answer(200, {"id": "org/gated", "gated": "manual"})
        else:
            self._answer(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})

    def _answer(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_online_the_hub_is_asked_whether_it_serves_each_model(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = check_in_subprocess([("a", "org/open"), ("b", "org/gated"), ("c", "org/missing")],
                                     hf_env(tmp_path, f"http://127.0.0.1:{server.server_port}", HF_HUB_OFFLINE="0"))
    finally:
        server.shutdown()
    why = {setting: reason for setting, _, reason in result["problems"]}
    assert set(why) == {"b", "c"}  # org/open is served: the loader downloads it
    assert why["b"].startswith("gated, and this user has no access: accept its licence")
    assert why["c"].startswith("no such model on the hub")


# ---------------------------------------------------------------------------------------------- the commands
@pytest.mark.parametrize("preset, model", [("sd35-grpo", SD35), ("flux-grpo", "black-forest-labs/FLUX.1-dev"),
                                           ("llada-gsm8k-grpo", "GSAI-ML/LLaDA-8B-Instruct")])
def test_a_preset_whose_model_is_not_cached_fails_in_a_few_lines_without_a_run_folder(tmp_path, preset, model):
    status, text = steadyrl(tmp_path, "train", "--local", str(CONFIG_DIR / f"{preset}.yaml"))
    assert_short_error(status, text, f"testbed.pretrained={model!r}", "not in the local Hugging Face cache",
                       "HF_HUB_OFFLINE=1")
    if preset != "llada-gsm8k-grpo":  # the image presets' reward models are named by their fields
        assert "testbed.reward.models[0].processor='laion/CLIP-ViT-H-14-laion2B-s32B-b79K'" in text, text
    assert not (tmp_path / "runs").exists()


def test_the_ray_runtime_fails_before_ray_is_imported_or_a_run_folder_made(tmp_path):
    site, mark = tmp_path / "site", tmp_path / "ray-imported"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import atexit, sys\natexit.register(lambda: open({str(mark)!r}, 'w').write(str('ray' in sys.modules)))\n")
    env = hf_env(tmp_path, PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    run = tmp_path / "run"
    status, text = steadyrl(tmp_path, "train", str(CONFIG_DIR / "sd35-grpo.yaml"), f"run.run_dir={run}", env=env)
    assert_short_error(status, text, f"testbed.pretrained={SD35!r}")
    assert mark.read_text() == "False"  # the process exited without importing Ray (so none started)
    assert not run.exists() and not (tmp_path / "runs").exists()


def test_pretrain_needs_the_pipeline_and_serve_reward_only_the_reward_models(tmp_path):
    status, text = steadyrl(tmp_path, "pretrain", str(CONFIG_DIR / "sd35-grpo.yaml"))
    assert_short_error(status, text, f"testbed.pretrained={SD35!r}", "4 models cannot be loaded")
    status, text = steadyrl(tmp_path, "serve-reward", str(CONFIG_DIR / "sd35-grpo.yaml"))
    assert_short_error(status, text, "3 models cannot be loaded", "testbed.reward.models[1].model")
    assert "testbed.pretrained" not in text


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from tests.tiny_models import save_tiny_clip, save_tiny_sd_pipeline

    root = tmp_path_factory.mktemp("model_sources")
    return {"sd": save_tiny_sd_pipeline(root / "sd"), "clip": save_tiny_clip(root / "clip")}


def t2i_overrides(tiny_models: dict[str, Path], processor: str, run_dir: Path) -> list[str]:
    """A text-to-image run on the tiny local pipeline: a local CLIP score, and a preference model whose weights are
    local but whose processor is `processor`."""
    clip = tiny_models["clip"]
    return ["testbed.name=text_to_image", f"testbed.pretrained={tiny_models['sd']}", "sampler.kind=ddim",
            f"testbed.reward.models=[{{kind: clip_score, model: {clip}}}, "
            f"{{kind: preference, model: {clip}, processor: {processor}}}]", "run.runtime=local",
            f"run.run_dir={run_dir}"]


def test_a_reward_models_missing_source_is_named_by_its_field(tiny_models, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from steadyrl.services.config import load_config
    from steadyrl.services.driver.controller import train
    from steadyrl.services.testbeds import build_testbed

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        train(overrides=t2i_overrides(tiny_models, "steadyrl-tests/no-such-processor", run))
    lines = str(err.value).splitlines()
    assert lines[:2] == ["a model cannot be loaded:", "  testbed.reward.models[1].processor='steadyrl-tests/no-such-"
                         "processor': not in the local Hugging Face cache, and no such directory"]
    assert "e.g. testbed.reward.models[1].processor=/path/to/local/copy" in lines[2] and not run.exists()
    # the same run with every source local passes the check (and names what it checked)
    cfg = load_config(None, t2i_overrides(tiny_models, str(tiny_models["clip"]), run))
    testbed = build_testbed(cfg)
    testbed.require_models()
    assert [s for s, _ in testbed.model_sources()] == [
        "testbed.pretrained", "testbed.reward.models[0].model", "testbed.reward.models[1].model",
        "testbed.reward.models[1].processor"]


def test_a_resume_checks_the_models_before_it_records_anything(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from steadyrl.services.config import dump_config, load_config
    from steadyrl.services.driver.controller import train

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(load_config(CONFIG_DIR / "llada-gsm8k-grpo.yaml")))
    with pytest.raises(ConfigError, match=r"testbed.pretrained='GSAI-ML/LLaDA-8B-Instruct': not in the local"):
        train(overrides=["run.runtime=local"], resume_dir=run)
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # no resumes.jsonl, no checkpoint looked for


def test_arith_loads_a_model_only_when_pretrained_is_set():
    from steadyrl.services.config import load_config
    from steadyrl.services.testbeds import build_testbed

    assert build_testbed(load_config(CONFIG_DIR / "arith-grpo.yaml")).model_sources() == []
    assert build_testbed(load_config(CONFIG_DIR / "digits-grpo.yaml")).model_sources() == []
    for preset in ("arith-ar-grpo", "arith-bd-grpo"):
        testbed = build_testbed(load_config(CONFIG_DIR / f"{preset}.yaml", ["testbed.pretrained=org/some-lm"]))
        assert testbed.model_sources() == testbed.reward_model_sources() == [("testbed.pretrained", "org/some-lm")]
