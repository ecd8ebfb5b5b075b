"""GRPO on the arith_ar testbed through real Ray, Serve and DeepSpeed with vLLM generating the rollouts: accuracy
rises against the base model, the engine's log-probs stay the learner's after every sync (through the object store
and through the learner's broadcast), and after its rollout worker is killed and restarted."""
from __future__ import annotations

import os
import signal

import pytest

from steadyrl.services.config import CONFIG_DIR
from steadyrl.services.driver.controller import train
from steadyrl.services.run_folder.metrics import read_metrics
from tests.helpers import actor_pid, steps_logged, train_in_thread, wait_for

PRESET = CONFIG_DIR / "arith-ar-vllm-grpo.yaml"
TOLERANCE = 1e-4  # per token, float32 engine vs float32 learner (tests/vllm_backend/test_vllm_engine.py)


@pytest.fixture(scope="module")
def killed_run(ray_cluster, serve_port, tmp_path_factory):
    """The preset (20 steps); its rollout worker is killed once step 3 is logged (Ray restarts it, the new
    engine starts from the base weights and loads the learner's latest before sampling)."""
    run = tmp_path_factory.mktemp("vllm") / "run"
    thread, out = train_in_thread(run, ["run.steps=20", "run.eval_every=20", "run.checkpoint_every=10",
                                        "run.progress=false", "serve.port=0"], config=PRESET)
    wait_for(lambda: steps_logged(run) >= 3 or not thread.is_alive(), "3 steps", timeout_s=600)
    os.kill(actor_pid(run, "rollout_0"), signal.SIGKILL)
    thread.join(timeout=1200)
    assert "error" not in out, out.get("error")
    return out["result"]


def test_grpo_with_vllm_rollouts_fixes_a_tenth_of_the_base_models_errors(killed_run):
    """Greedy exact match on the same held-out sums before and after 20 steps (one of them killed and resumed).
    Relative to the base's errors, as tests/test_e2e_arith_ar.py: pre-trained bases differ between installs
    (2026-12-02: 80.6 -> 89.7 %, 47 % of the errors fixed; 2026-12-03: 87.3 -> 89.1 %, 14 %), so a fixed gain in
    points holds on one and not the other."""
    base, final = killed_run.base_eval, killed_run.final_eval
    assert killed_run.steps_done == 20 and base["n_samples"] == final["n_samples"]
    assert 1 - final["held_out"] <= 0.9 * (1 - base["held_out"]), (base["held_out"], final["held_out"])


def test_the_engine_scores_as_the_learner_after_every_sync_and_after_a_restart(killed_run):
    rows = read_metrics(killed_run.run_dir)
    assert max(r["faults/rollout_restarts"] for r in rows) >= 1
    gaps = [r["policy/rollout_token_logp_absdiff_max"] for r in rows]
    assert len(gaps) == 20 and max(gaps) < TOLERANCE, gaps
    # the engine's samples are weighed by min(pi_learner / pi_vllm, cap): within the tolerance, 1 to 1e-4
    assert all(abs(r["async/behaviour_weight_mean"] - 1) < 1e-3 for r in rows)


def test_the_learners_broadcast_reaches_the_engine(ray_cluster, serve_port, tmp_path):
    """ray.weight_sync=collective: learner rank 0 broadcasts over gloo to the rollout worker, which loads the tensors
    into its engine; the engine's log-probs then match the learner's at every later step."""
    result = train(PRESET, [f"run.run_dir={tmp_path / 'run'}", "run.steps=4", "run.eval_every=4",
                            "run.progress=false", "serve.port=0", "ray.weight_sync=collective"])
    rows = read_metrics(result.run_dir)
    assert len(rows) == 4 and all(r["policy/kl_ref_monitor"] >= 0 for r in rows)
    assert max(r["policy/rollout_token_logp_absdiff_max"] for r in rows) < TOLERANCE
    assert rows[-1]["policy/kl_ref_monitor"] > 0  # the weights did move, and the engine followed them
