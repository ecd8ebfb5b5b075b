"""The reward ensemble as a real Ray Serve application, over HTTP on 127.0.0.1 and by handle."""
from __future__ import annotations

import httpx
import pytest
import torch

from steadyrl.rollout.digits import digit_splits, load_digits_tensors


@pytest.fixture(scope="module")
def digits():
    images, labels = load_digits_tensors()
    idx = torch.as_tensor(digit_splits().test[:24])
    return images[idx], labels[idx]


def test_score_real_digits_over_http(reward_url, digits):
    images, labels = digits
    body = {"samples": images[:, 0].tolist(), "cond": labels.tolist(), "group": [i // 8 for i in range(24)]}
    resp = httpx.post(f"{reward_url}/score", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["names"] == ["cnn", "mlp", "linear"] and out["train_on"] == "cnn"
    scores = torch.tensor(out["scores"])
    assert scores.shape == (24, 3)
    assert torch.allclose(torch.tensor(out["mean"]), scores.mean(1), atol=1e-5)
    assert torch.allclose(torch.tensor(out["reward"]), scores[:, 0])
    assert sum(out["monitors"]["gold_correct"]) >= 22  # real digits: the gold judge agrees
    assert all(0 <= u <= 0.5 for u in out["uncertainty"])
    # asking for the wrong digit drops the reward
    wrong = httpx.post(f"{reward_url}/score", json={**body, "cond": ((labels + 1) % 10).tolist()}, timeout=60).json()
    assert sum(wrong["reward"]) < 0.2 * sum(out["reward"])


@pytest.mark.parametrize("body, field", [
    ({"samples": [[[0.0] * 8] * 8], "cond": [1, 2]}, "cond"),
    ({"samples": [[[0.0] * 7] * 8], "cond": [1]}, "samples"),
    ({"samples": [[[0.0] * 8] * 8], "cond": [12]}, "cond"),
    ({"cond": [1]}, "samples"),
    ({"samples": [[[0.0] * 8] * 8], "cond": [1], "extra": 1}, "extra"),
    ({"samples": [[["a"] * 8] * 8], "cond": [1]}, "samples"),
])
def test_bad_request_body_gets_422_naming_the_field(reward_url, body, field):
    resp = httpx.post(f"{reward_url}/score", json=body, timeout=30)
    assert resp.status_code == 422
    locs = [".".join(str(p) for p in e["loc"]) for e in resp.json()["detail"]]
    assert any(field in loc or field in e["msg"] for loc, e in zip(locs, resp.json()["detail"])), resp.json()


def test_healthz_and_openapi(reward_url):
    health = httpx.get(f"{reward_url}/healthz", timeout=30).json()
    assert health["status"] == "ok" and health["gold"] == "gold"
    assert {m["name"] for m in health["models"]} == {"cnn", "mlp", "linear", "gold"}
    spec = httpx.get(f"{reward_url}/openapi.json", timeout=30).json()
    assert "/score" in spec["paths"] and "ScoreRequest" in str(spec["components"])
    assert httpx.get(f"{reward_url}/docs", timeout=30).status_code == 200


def test_in_cluster_handle_batches_concurrent_calls(reward_url, digits):
    """Concurrent handle calls are answered correctly (the member deployments batch them)."""
    from ray import serve

    from steadyrl.services.reward_app import APP_NAME

    images, labels = digits
    handle = serve.get_app_handle(APP_NAME)
    responses = [handle.score_tensors.remote(images[i : i + 4], labels[i : i + 4]) for i in range(0, 24, 4)]
    results = [r.result() for r in responses]
    whole = handle.score_tensors.remote(images, labels).result()
    assert torch.allclose(torch.cat([r.scores for r in results]), whole.scores, atol=1e-5)
    assert whole.features is not None and whole.features.shape[0] == 24
