"""The text-to-image reward ensemble (`ImageRewardConfig`) as a real Ray Serve application over HTTP on
127.0.0.1 (POST /v1/score, records tagged "text_to_image") and by handle (`score_tensors`), against the same models in-process.

Tiny random CLIPs are built offline (tests/tiny_models.py). The app is deployed under its own name and route
prefix, so the digits app the other Serve tests use stays as it is, and is deleted at the end.
"""
from __future__ import annotations

import base64
import io

import httpx
import pydantic
import pytest
import torch
from PIL import Image

from steadyrl.reward.config import ImageRewardConfig
from steadyrl.reward.factory import AestheticSpec, ClipScoreSpec, JpegSpec
from tests.helpers import make_testbed
from tests.tiny_models import save_tiny_aesthetic_head, save_tiny_clip

DIM, SIZE = 16, 32
APP, PREFIX = "reward_images_test", "/reward_images_test"
PROMPTS = ["a photo of a cat", "the dog and a ball", "a red car", "an apple on a table", "abstract art, 4k!",
           "a bowl of soup"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-images")
    clip = save_tiny_clip(root / "clip", projection_dim=DIM, image_size=SIZE, seed=0)
    return {"clip": str(clip), "head": str(save_tiny_aesthetic_head(root / "head.pth", DIM, seed=2))}


@pytest.fixture(scope="module")
def cfg(tiny) -> ImageRewardConfig:
    """CLIP score and JPEG are trained on; the aesthetic model only watches."""
    return ImageRewardConfig(
        models=[ClipScoreSpec(name="clip", model=tiny["clip"], scale=2.5),
                AestheticSpec(name="aesthetic", model=tiny["clip"], head=tiny["head"]),
                JpegSpec(name="jpeg", upscale=1)],
        monitor_only=["aesthetic"])


@pytest.fixture(scope="module")
def ensemble(cfg):
    return cfg.ensemble_spec().build()


@pytest.fixture(scope="module")
def images_url(serve_port, cfg):
    from ray import serve

    from steadyrl.services.serving import deploy_reward_app
    from steadyrl.services.testbeds import TextToImageSettings

    deploy_reward_app(make_testbed(TextToImageSettings(pretrained="not-loaded-by-the-reward-app", reward=cfg)),
                      name=APP, route_prefix=PREFIX)
    yield f"http://127.0.0.1:{serve_port}{PREFIX}"
    serve.delete(APP)


def pixels(batch: int, h: int = SIZE, w: int = SIZE, seed: int = 0) -> torch.Tensor:
    """Random 8-bit RGB images [B,3,H,W] (uint8): exact in a PNG and in model space."""
    return torch.randint(0, 256, (batch, 3, h, w), generator=torch.Generator().manual_seed(seed)).to(torch.uint8)


def model_space(px: torch.Tensor) -> torch.Tensor:
    return px.float() / 127.5 - 1


def png_b64(img: torch.Tensor) -> str:
    """One uint8 image [3,H,W] as a base64 PNG, written with PIL (independently of the app's encoder)."""
    buf = io.BytesIO()
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def close(a, b, atol: float = 1e-5) -> bool:
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                          atol=atol)


# ---------------------------------------------------------------------------------------------- config


def test_default_config_needs_no_download_and_scores_prompted_images():
    cfg = ImageRewardConfig()
    assert [(m.kind, m.upscale) for m in cfg.models] == [("jpeg", 1)]
    assert cfg.train_on == "mean" and cfg.monitor_specs() == [] and cfg.feature_model_name() is None
    out = cfg.ensemble_spec().build().score_all(model_space(pixels(3)), ["a", "b", "c"])
    assert out.names == ["jpeg_compressibility"] and out.scores.shape == (3, 1)
    assert out.features is None and out.monitors == {}
    assert ImageRewardConfig.model_validate({}).models == cfg.models  # a config without a reward section


def test_roles_and_feature_model(cfg, tiny):
    assert [s.name for s in cfg.trained_specs()] == ["clip", "jpeg"]
    assert [s.name for s in cfg.monitor_specs()] == ["aesthetic"]
    assert cfg.feature_model_name() == "clip"  # the first trained model with features
    cfg2 = ImageRewardConfig(models=[JpegSpec(upscale=1), AestheticSpec(model=tiny["clip"], head=tiny["head"])],
                             train_on="aesthetic", feature_model="aesthetic")
    assert cfg2.feature_model_name() == "aesthetic"
    models = [{"kind": "jpeg", "upscale": 1}, {"kind": "clip_score", "name": "c", "model": "x"}]
    assert ImageRewardConfig.model_validate({"models": models, "train_on": "c"}).feature_model_name() == "c"


BAD = [
    ({"models": []}, "models"),
    ({"models": [{"kind": "jpeg"}, {"kind": "jpeg"}]}, "models"),
    ({"models": [{"kind": "classifier", "name": "cnn"}]}, "models"),
    ({"models": [{"kind": "clip_score", "model": "x", "scale": -1}]}, "models"),
    ({"monitor_only": ["nope"]}, "monitor_only"),
    ({"monitor_only": ["jpeg_compressibility"]}, "monitor_only"),  # nothing left to train on
    ({"models": [{"kind": "jpeg"}, {"kind": "jpeg", "name": "j2"}], "monitor_only": ["j2", "j2"]}, "monitor_only"),
    ({"train_on": "nope"}, "train_on"),
    ({"models": [{"kind": "jpeg"}, {"kind": "jpeg", "name": "j2"}], "monitor_only": ["j2"], "train_on": "j2"},
     "train_on"),
    ({"feature_model": "jpeg_compressibility"}, "feature_model"),  # no features
    ({"feature_model": "nope"}, "feature_model"),
    ({"models": [{"kind": "jpeg"}, {"kind": "clip_score", "model": "x"}], "monitor_only": ["clip_score"],
      "feature_model": "clip_score"}, "feature_model"),  # monitor-only: its features would reach training
    ({"gold": "x"}, "gold"),
]


@pytest.mark.parametrize("data, field", BAD)
def test_config_errors_name_the_field(data, field):
    with pytest.raises(pydantic.ValidationError) as info:
        ImageRewardConfig.model_validate(data)
    errors = info.value.errors()
    assert any(e["loc"] and e["loc"][0] == field for e in errors), errors
    if field != "gold":  # our own validators also say `reward.<field>` in the message
        assert any(f"reward.{field}" in e["msg"] for e in errors) or field == "models" and any(
            e["type"] != "value_error" for e in errors), errors
    with pytest.raises(pydantic.ValidationError):  # nested as a training config's `reward` section
        pydantic.TypeAdapter(dict[str, ImageRewardConfig]).validate_python({"reward": data})


# ------------------------------------------------------------------ the deployment class, without Ray


def test_deployment_health_check_and_info_for_each_kind(cfg):
    """check_health scores a grey image (with a prompt for the CLIP kinds); Serve also runs it before a
    replica counts as started. (`score`'s batching needs a replica: the handle test below covers it.)"""
    from steadyrl.services.serving import RewardModelDeployment

    for spec in cfg.models:
        dep = RewardModelDeployment.func_or_class(spec.model_dump())
        dep.check_health()
        assert dep.info()["name"] == spec.name and dep.info()["kind"] == spec.kind


def test_every_kinds_health_probe_scores_finitely_and_a_nan_score_fails_check_health(tiny, tmp_path):
    """Each kind `build_reward_model` builds names its own probe (`RewardModel.health_probe`): one input its model
    scores to one finite value, or None for the verifier (a pure function of text) and a user's function (an input
    of ours might not suit it; a remote scorer, probed when it is built). check_health scores that probe and nothing
    else: a model whose scores turn NaN fails it naming the model; the verifier and a user's function or remote
    scorer are never scored by it."""
    from typing import get_args

    from fastapi import FastAPI

    from steadyrl.reward.config import RewardConfig
    from steadyrl.reward.factory import PreferenceSpec, RewardSpec
    from steadyrl.reward.http_reward import HttpRewardSpec
    from steadyrl.reward.ocr_reward import OcrSpec
    from steadyrl.reward.python_reward import PythonRewardSpec
    from steadyrl.reward.verifiers import VerifierSpec
    from steadyrl.services.serving import RewardModelDeployment
    from tests.helpers import serving

    (tmp_path / "mine.py").write_text("def score(images, prompts):\n    return [1.0] * len(images)\n")

    specs = [RewardConfig().member_specs()[0], JpegSpec(), VerifierSpec(), ClipScoreSpec(model=tiny["clip"]),
             AestheticSpec(model=tiny["clip"], head=tiny["head"]), PreferenceSpec(model=tiny["clip"], processor=None),
             PythonRewardSpec(name="mine", function=f"{tmp_path / 'mine.py'}:score"), OcrSpec()]
    with serving(FastAPI()) as url:  # a server to reach: the remote scorer is probed when built
        specs.append(HttpRewardSpec(name="remote", url=url, protocol="flow_grpo", allow_pickle=True))
        kinds = [get_args(t)[0].model_fields["kind"].default for t in get_args(get_args(RewardSpec)[0])]
        assert sorted(s.kind for s in specs) == sorted(kinds)  # every built-in kind
        for spec in specs:
            dep = RewardModelDeployment.func_or_class(spec.model_dump())
            probe = dep.model.health_probe()
            assert (probe is None) == (spec.kind in ("verifier", "python", "http")), spec.kind
            if probe is not None:
                out = dep.model.score(*probe)
                assert out.shape == (1,) and bool(out.isfinite().all()), (spec.kind, out)
            dep.check_health()
            dep.model.score = lambda samples, cond: torch.full((len(cond),), float("nan"))
            if probe is None:
                dep.check_health()
            else:
                with pytest.raises(RuntimeError, match=f"reward model {spec.name} returns non-finite scores"):
                    dep.check_health()


def test_png_round_trip_is_exact_in_model_space():
    from steadyrl.services.testbeds.png import decode_png, encode_png
    from steadyrl.services.testbeds.text_to_image.rest import TextToImageRequest

    px = pixels(2, 24, 40, seed=5)
    assert torch.equal(torch.from_numpy(decode_png(encode_png(model_space(px)[0]))).permute(2, 0, 1), px[0])
    grey = io.BytesIO()
    Image.fromarray(px[1, 0].numpy()).save(grey, format="PNG")  # grey PNGs come back as RGB
    req = TextToImageRequest(samples=[{"image": png_b64(px[0]), "prompt": "a"}, {"image": "data:image/png;base64,"
                                      + base64.b64encode(grey.getvalue()).decode(), "prompt": "b"}])
    batch = req.batch()
    x = batch.samples
    assert torch.equal(x[0], model_space(px[0])) and torch.equal(x[1], model_space(px[1, :1]).expand(3, -1, -1))
    assert batch.cond == ["a", "b"] and batch.group.tolist() == [0, 0]


# -------------------------------------------------------------------------------- over HTTP and handle


def test_score_images_over_http_matches_the_in_process_ensemble(images_url, ensemble):
    px = pixels(6, seed=10)
    group = [0, 0, 0, 1, 1, 1]
    body = {"kind": "text_to_image", "samples": [{"image": png_b64(img), "prompt": p, "group": g}
                                                 for img, p, g in zip(px, PROMPTS, group)]}
    resp = httpx.post(f"{images_url}/v1/score", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    ref = ensemble.score_all(model_space(px), PROMPTS, torch.tensor(group))
    assert out["names"] == ref.names == ["clip", "jpeg"] and out["train_on"] == "mean"
    for key in ("scores", "mean", "std", "uncertainty", "reward"):
        assert close(out[key], getattr(ref, key)), key
    # the monitor-only model is reported, never part of the ensemble or its reward
    assert set(out["monitors"]) == {"aesthetic"} and "aesthetic" not in out["names"]
    assert close(out["monitors"]["aesthetic"], ref.monitors["aesthetic"])
    assert close(out["reward"], torch.tensor(out["scores"]).mean(1))
    assert not close(out["reward"], torch.tensor(out["monitors"]["aesthetic"]), atol=1e-3)


def test_non_square_images_and_no_group_over_http(images_url, ensemble):
    px = pixels(3, 40, 56, seed=11)  # resized and center-cropped by the CLIP preprocessing
    resp = httpx.post(f"{images_url}/v1/score", json={"samples": [{"image": png_b64(i), "prompt": p}
                                                               for i, p in zip(px, PROMPTS)]}, timeout=120)
    assert resp.status_code == 200, resp.text
    ref = ensemble.score_all(model_space(px), PROMPTS[:3])
    assert close(resp.json()["scores"], ref.scores) and close(resp.json()["monitors"]["aesthetic"],
                                                              ref.monitors["aesthetic"])


def _bad_bodies() -> list:
    ok = png_b64(pixels(1)[0])
    other = png_b64(pixels(1, 24, 32)[0])
    truncated = base64.b64encode(base64.b64decode(ok)[:60]).decode()
    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg, format="JPEG")

    def recs(*images: str, prompts: tuple = ("a", "b", "c")) -> list[dict]:
        return [{"image": img, "prompt": p} for img, p in zip(images, prompts)]

    return [
        ({"samples": recs(ok, "not base64!")}, "samples.1.image"),
        ({"samples": recs(ok, ok, truncated)}, "samples.2.image"),
        ({"samples": recs(base64.b64encode(jpeg.getvalue()).decode())}, "samples.0.image"),
        ({"samples": recs(ok, other)}, "samples.image: all images in one request must have the same size"),
        ({"samples": [{"image": ok}]}, "samples.0.prompt"),
        ({"samples": [{"image": ok, "prompt": "a", "group": "x"}]}, "samples.0.group"),
        ({"samples": []}, "samples"),
        ({"samples": [{"image": ok, "prompt": 3}]}, "samples.0.prompt"),
        ({"samples": recs(ok), "cond": [1]}, "cond"),
        ({"kind": "digits", "samples": recs(ok)}, "kind"),
    ]


@pytest.mark.parametrize("index", range(10))
def test_bad_image_requests_get_422_naming_the_field(images_url, index):
    body, field = _bad_bodies()[index]
    resp = httpx.post(f"{images_url}/v1/score", json=body, timeout=60)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert any(".".join(map(str, e["loc"])).startswith(f"body.{field}") or field in e["msg"] for e in detail), detail


def test_deprecated_parallel_arrays_still_score_and_share_the_lengths_check(images_url):
    ok = png_b64(pixels(1)[0])
    resp = httpx.post(f"{images_url}/score_images", json={"images": [ok, ok], "prompts": ["a", "b"]}, timeout=60)
    assert resp.status_code == 200 and len(resp.json()["reward"]) == 2
    bad = httpx.post(f"{images_url}/score_images", json={"images": [ok, ok], "prompts": ["a"]}, timeout=60)
    assert bad.status_code == 422 and "prompts has 1 entries but images has 2" in bad.text


def test_oversized_image_is_refused(images_url):
    from steadyrl.services.testbeds.png import MAX_IMAGE_SIDE

    buf = io.BytesIO()
    Image.new("RGB", (MAX_IMAGE_SIDE + 1, 1)).save(buf, format="PNG")  # tiny file, absurd side
    body = {"samples": [{"image": base64.b64encode(buf.getvalue()).decode(), "prompt": "a"}]}
    resp = httpx.post(f"{images_url}/v1/score", json=body, timeout=60)
    assert resp.status_code == 422 and str(MAX_IMAGE_SIDE) in resp.text
    assert resp.json()["detail"][0]["loc"] == ["body", "samples", 0, "image"]


def test_other_routes_answer_400_and_healthz_openapi_describe_the_app(images_url):
    wrong = httpx.post(f"{images_url}/score", json={"samples": [[[0.0] * 8] * 8], "cond": [1]}, timeout=60)
    assert wrong.status_code == 400 and "/v1/score" in wrong.text and "/score_images" in wrong.text
    health = httpx.get(f"{images_url}/healthz", timeout=60).json()
    assert health["testbed"] == "text_to_image" and health["members"] == ["clip", "jpeg"]
    assert health["monitors"] == ["aesthetic"] and health["feature_model"] == "clip"
    assert {(m["name"], m["kind"]) for m in health["models"]} == {("clip", "clip_score"), ("jpeg", "jpeg"),
                                                                   ("aesthetic", "aesthetic")}
    models = httpx.get(f"{images_url}/v1/models", timeout=60).json()["models"]
    assert [(m["name"], m["role"], m["trained_on"]) for m in models] == [
        ("clip", "member", True), ("jpeg", "member", True), ("aesthetic", "monitor", False)]  # train_on: mean
    spec = httpx.get(f"{images_url}/openapi.json", timeout=60).json()
    assert set(spec["paths"]) == {"/v1/score", "/v1/models", "/healthz"}
    schemas = spec["components"]["schemas"]
    assert schemas["TextToImageRequest"]["properties"]["kind"]["const"] == "text_to_image"
    image = schemas["TextToImageSample"]["properties"]["image"]
    assert image["type"] == "string" and image["contentMediaType"] == "image/png"


def test_in_cluster_handle_gives_the_same_numbers(images_url, ensemble):
    """score_tensors(images, prompts, group) by handle, concurrently and with two image sizes, equals the
    in-process ensemble (features from the feature model included)."""
    from ray import serve

    handle = serve.get_app_handle(APP)
    x = model_space(pixels(6, seed=12))
    y = model_space(pixels(2, 48, 40, seed=13))
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    parts = [handle.score_tensors.remote(x[i:i + 2], PROMPTS[i:i + 2], group[i:i + 2]) for i in range(0, 6, 2)]
    odd = handle.score_tensors.remote(y, PROMPTS[:2], [0, 0])
    whole = handle.score_tensors.remote(x, PROMPTS, group).result()
    ref = ensemble.score_all(x, PROMPTS, group)
    assert whole.names == ref.names and close(whole.scores, ref.scores) and close(whole.reward, ref.reward)
    assert close(whole.uncertainty, ref.uncertainty)
    assert close(whole.monitors["aesthetic"], ref.monitors["aesthetic"])
    assert whole.features is not None and whole.features.shape == (6, DIM) and close(whole.features, ref.features)
    assert close(torch.cat([p.result().scores for p in parts]), ref.scores)
    ref_odd = ensemble.score_all(y, PROMPTS[:2], torch.tensor([0, 0]))
    out_odd = odd.result()
    assert close(out_odd.scores, ref_odd.scores) and close(out_odd.monitors["aesthetic"], ref_odd.monitors["aesthetic"])
    with pytest.raises(Exception, match="cond"):
        handle.score_tensors.remote(x, PROMPTS[:2]).result()
