"""serve.colocate_models: the reward ensemble's models hosted in the ingress's own replica. Over HTTP and by handle
it answers exactly as the app with one replica per model, from one Serve replica (the session's digits app, as
configs/smoke.yaml deploys it)."""
from __future__ import annotations

import httpx
import pytest
import torch

from steadyrl.rollout.digits import digit_splits, load_digits_tensors
from steadyrl.services.config import ServeConfig
from steadyrl.services.serving.deployments import InProcessModel, RewardEnsembleIngress
from steadyrl.services.testbeds import DigitsSettings
from tests.helpers import make_testbed

APP, PREFIX = "reward_per_model_test", "/reward_per_model_test"


@pytest.fixture(scope="module")
def per_model_url(serve_port):
    from ray import serve

    from steadyrl.services.serving import deploy_reward_app

    deploy_reward_app(make_testbed(DigitsSettings()), ServeConfig(colocate_models=False), name=APP,
                      route_prefix=PREFIX)
    yield f"http://127.0.0.1:{serve_port}{PREFIX}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def digits_records():
    images, labels = load_digits_tensors()
    idx = torch.as_tensor(digit_splits().test[:16])
    return images[idx], labels[idx]


def test_a_colocated_app_runs_one_replica_and_scores_exactly_as_the_per_model_app(reward_url, per_model_url,
                                                                                  digits_records):
    from ray import serve

    from steadyrl.services.serving import APP_NAME

    images, labels = digits_records
    body = {"kind": "digits", "samples": [{"image": img[0].tolist(), "digit": int(y), "group": i // 4}
                                          for i, (img, y) in enumerate(zip(images, labels))]}
    colocated = httpx.post(f"{reward_url}/v1/score", json=body, timeout=60)
    per_model = httpx.post(f"{per_model_url}/v1/score", json=body, timeout=60)
    assert colocated.status_code == 200, colocated.text
    assert colocated.json() == per_model.json()  # scores, reward, uncertainty, monitors: the same numbers
    assert list(serve.status().applications[APP_NAME].deployments) == ["ensemble"]
    assert len(serve.status().applications[APP].deployments) == 5  # ensemble + 3 members + the gold monitor
    by_handle = serve.get_app_handle(APP_NAME).score_tensors.remote(images, labels).result()
    reference = serve.get_app_handle(APP).score_tensors.remote(images, labels).result()
    assert torch.equal(by_handle.scores, reference.scores) and torch.equal(by_handle.features, reference.features)
    health = httpx.get(f"{reward_url}/healthz", timeout=60).json()
    assert [m["name"] for m in health["models"]] == ["cnn", "mlp", "linear", "gold"]


def test_the_setting_is_part_of_the_apps_digest():
    """A run asking for the other layout does not reuse a running app (deploy_reward_app's `reuse`)."""
    from steadyrl.services.serving.app import app_digest

    testbed = make_testbed(DigitsSettings())
    spec, profile = testbed.reward_spec(), testbed.rest
    assert app_digest(spec, profile, ServeConfig()) != app_digest(spec, profile, ServeConfig(colocate_models=True))


def test_a_hosted_models_errors_reach_the_awaiting_caller_and_its_health_check():
    """In-process calls fail where a handle's would, when awaited; the ingress's health check runs each hosted
    model's, so Serve replaces a replica whose model went bad."""
    import asyncio

    testbed = make_testbed(DigitsSettings())
    spec = testbed.reward_spec()
    model = InProcessModel(spec.members[0].model_dump())
    call = model.score.remote(torch.zeros(2, 1, 8, 8), torch.zeros(3, dtype=torch.long))  # 3 conds for 2 samples
    with pytest.raises(ValueError, match="cond has 3 entries for 2 samples"):
        asyncio.run(call)
    ingress_cls = RewardEnsembleIngress.func_or_class
    ingress = ingress_cls.__new__(ingress_cls)
    ingress.members, ingress.monitors = [model], []
    ingress.check_health()  # a sound model passes
    for p in model.model.model.model.parameters():  # deployment -> reward model -> torch module
        p.data.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="non-finite scores"):
        ingress.check_health()
