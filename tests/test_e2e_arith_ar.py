"""The arith_ar testbed (an autoregressive LM, the transformers backend) through real Ray, Serve (the verifier over
HTTP too) and DeepSpeed: token-level GRPO fixes the base model's errors."""
from __future__ import annotations

import httpx
import pytest

from steadyrl.services.config import CONFIG_DIR
from steadyrl.services.driver.controller import train
from steadyrl.services.run_folder.metrics import read_metrics


@pytest.fixture(scope="module")
def arith_ar_run(ray_cluster, serve_port, tmp_path_factory):
    """The preset (20 steps), evaluated at the start and the end only."""
    run_dir = tmp_path_factory.mktemp("arith_ar") / "run"
    result = train(CONFIG_DIR / "arith-ar-grpo.yaml",
                   [f"run.run_dir={run_dir}", "run.steps=20", "run.eval_every=20", "run.checkpoint_every=20",
                    "run.progress=false", "serve.port=0"])
    assert not result.interrupted and result.steps_done == 20
    return result


def test_token_level_grpo_on_the_causal_lm_fixes_a_fifth_of_the_errors(arith_ar_run):
    """+8.1, +25.8, +9.6, +14.0 and +9.4 points after 20 steps over pre-training seeds 0-4 (docs/testbeds.md, the
    2026-12-02 install); the 2026-12-03 install pre-trains seed 0 to a stronger base, 87.3 -> 91.1 %: a share of
    the base's errors holds for both where a fixed gain in points does not."""
    base, final = arith_ar_run.base_eval, arith_ar_run.final_eval
    assert base["n_samples"] == final["n_samples"] == 1000
    assert 1 - final["held_out"] <= 0.8 * (1 - base["held_out"]), (base["held_out"], final["held_out"])
    rows = read_metrics(arith_ar_run.run_dir)
    # the KV-cached float32 generation and the learner's one-pass recompute agree per token
    assert max(r["policy/rollout_token_logp_absdiff_max"] for r in rows) < 1e-4


def test_the_arith_ar_verifier_app_scores_completions_over_http(serve_port):
    from ray import serve

    from steadyrl.services.config import load_config
    from steadyrl.services.serving import deploy_reward_app
    from steadyrl.services.testbeds import build_testbed

    deploy_reward_app(build_testbed(load_config(CONFIG_DIR / "arith-ar-grpo.yaml")), name="arith_ar_http",
                      route_prefix="/arith_ar")
    try:
        body = {"kind": "arith_ar", "samples": [{"prompt": "07+45=", "completion": "52"},
                                                {"prompt": "07+45=", "completion": "53"}]}
        r = httpx.post(f"http://127.0.0.1:{serve_port}/arith_ar/v1/score", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["reward"] == [1.0, 0.0] and r.json()["monitors"]["exact_correct"] == [1.0, 0.0]
        wrong_kind = httpx.post(f"http://127.0.0.1:{serve_port}/arith_ar/v1/score",
                                json={**body, "kind": "arith"}, timeout=60)
        assert wrong_kind.status_code == 422 and "kind" in wrong_kind.text
    finally:
        serve.delete("arith_ar_http")
