"""The GPU smoke check's CPU half: its parity harness tells equal first steps from different ones, and the whole
script, from the wheel set installed into a fresh venv that holds torch and what a GPU node comes with (no Ray),
runs to its end on the CPU with every GPU part reported skipped, never passed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from benchmarks import gpu_parity, gpu_smoke

ROOT = Path(__file__).resolve().parents[1]
#: what the GPU node this is written for has installed besides torch (docs/gpu.md); pip adds their dependencies
NODE_HAS = ("transformers", "peft", "accelerate", "safetensors", "rich", "typer", "matplotlib", "tensorboard")


def sd3_config(tmp: Path, *extra: str):
    from steadyrl.services.config import load_config

    overrides = gpu_smoke.case_overrides(gpu_smoke.CASES["sd3"], tmp, "float32")
    return load_config(None, [*overrides, *gpu_smoke.CPU_ONLY, *extra])


def test_the_parity_harness_finds_a_replayed_first_step_equal_and_other_noise_not(tmp_path):
    ref = gpu_parity.first_step(sd3_config(tmp_path), "cpu")
    assert ref["alarm"] == 0.0 and ref["sync"]["equal"] and ref["sync"]["bytes"] > 0
    same = gpu_parity.compare(gpu_parity.first_step(sd3_config(tmp_path), "cpu", reference=ref["batch"]), ref,
                              "float32")
    assert same["ok"] and all(v["error"] == 0.0 for k, v in same.items() if k != "ok"), same
    # another seed draws other noise: its own samples' log-probs differ; trained on the reference batch, its
    # recompute at the same base weights does not
    other = gpu_parity.compare(gpu_parity.first_step(sd3_config(tmp_path, "run.seed=1"), "cpu",
                                                     reference=ref["batch"]), ref, "float32")
    assert not other["ok"] and not other["rollout_logp"]["ok"] and other["recomputed_logp"]["ok"], other


@pytest.mark.parametrize("name", sorted(gpu_smoke.CASES))
def test_each_cases_gpu_phase_given_the_cpu_reproduces_its_cpu_reference_exactly(tmp_path, name):
    """The code the GPU runs (parity per dtype, then a short `steadyrl train --local`), with the CPU as its
    device: every parity error is exactly 0 and the training run is finite."""
    case = gpu_smoke.CASES[name]
    ref = gpu_smoke.run_cpu_phase(case, tmp_path)
    assert set(ref) == set(case.dtypes)
    done = gpu_smoke.run_device_phase(case, tmp_path, steps=2, device="cpu")
    assert set(done["parity"]) == set(case.dtypes)
    for dtype, checks in done["parity"].items():
        assert checks["ok"] and all(v["error"] == 0.0 for k, v in checks.items() if k != "ok"), (dtype, checks)
    assert done["train"]["ok"] and done["train"]["steps"] == 2 and done["train"]["samples_per_s"] > 0


def test_a_case_passes_only_when_its_gpu_part_ran_and_held():
    ran = {"status": "ran"}
    held = {"float32": {"ok": True, "loss": {"error": 0.0, "tolerance": 1e-3, "ok": True}}}
    off = {"float32": {"ok": False, "loss": {"error": 1.0, "tolerance": 1e-3, "ok": False}}}
    assert gpu_smoke.case_status(ran, None)[0] == "skipped"
    assert gpu_smoke.case_status({"status": "error", "error": "x"}, None)[0] == "failed"
    assert gpu_smoke.case_status(ran, {"status": "ran", "parity": held, "train": {"ok": True}})[0] == "passed"
    assert gpu_smoke.case_status(ran, {"status": "ran", "parity": off, "train": {"ok": True}}) == \
        ("failed", "float32 loss")
    assert gpu_smoke.case_status(ran, {"status": "ran", "parity": held, "train": {"ok": False}})[0] == "failed"
    assert gpu_smoke.case_status(ran, {"status": "error", "error": "timed out after 9 s"}) == \
        ("failed", "timed out after 9 s")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.mark.slow
def test_the_smoke_script_runs_to_its_end_on_cpu_from_the_wheel_set_in_a_venv_without_ray(tmp_path):
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    py_version = f"{sys.version_info.major}.{sys.version_info.minor}"  # this interpreter's: the venv's torch is here
    run([sys.executable, str(ROOT / "benchmarks/gpu_wheels.py"), "--python", py_version, "--out", str(wheels)],
        cwd=ROOT, timeout=1200)
    run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    py = str(venv / "bin" / "python")
    run([py, "-m", "pip", "install", "--quiet", f"torch=={metadata.version('torch')}"], timeout=900)
    run([py, "-m", "pip", "install", "--quiet", *[f"{n}=={metadata.version(n)}" for n in NODE_HAS]], timeout=900)
    assert run([py, "-c", "import importlib.util as u; print(u.find_spec('ray'), u.find_spec('diffusers'))"]
               ).stdout.split() == ["None", "None"]  # the node's state: neither Ray nor diffusers yet
    out_json = tmp_path / "smoke.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=py, PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    done = run(["bash", str(ROOT / "benchmarks/gpu_smoke.sh"), str(wheels), "--out", str(out_json), "--jobs", "1"],
               cwd=tmp_path, env=env, timeout=1800)
    report = json.loads(out_json.read_text())
    assert report["device"] == "cpu" and report["cuda"] is False
    assert report["packages"]["ray"] is None and report["packages"]["diffusers"] and report["packages"]["deepspeed"]
    rows = {c["case"]: c for c in report["cases"]}
    assert sorted(rows) == sorted([*gpu_smoke.CASES, *gpu_smoke.CHECKS])
    assert {c["status"] for c in rows.values()} == {"skipped"}, {n: (c["status"], c.get("reason")) for n, c in rows.items()}
    for name in gpu_smoke.CASES:  # the CPU half of every case ran in the wheel-installed venv
        ref = rows[name]["cpu_reference"]
        assert ref["status"] == "ran" and set(ref) >= set(gpu_smoke.CASES[name].dtypes), (name, ref)
        assert all(ref[d]["alarm"] == 0.0 and ref[d]["sync_equal"] for d in gpu_smoke.CASES[name].dtypes), (name, ref)
    assert report["summary"] == {"passed": 0, "failed": 0, "skipped": len(rows)}
    assert f"0 passed, 0 failed, {len(rows)} skipped" in done.stdout


def test_a_phase_that_cannot_start_within_the_budget_fails_saying_so(tmp_path):
    import time

    phase = gpu_smoke.spawn("cpu", "sd3", tmp_path / "sd3", 240.0, 1, 1, deadline=time.monotonic() + 5)
    assert phase.result == {"status": "error", "error": "not started: the run's --budget was spent"}
    assert gpu_smoke.case_status(phase.result, None) == ("failed", "CPU reference: not started: the run's --budget "
                                                                   "was spent")
