"""The OCR reward (`kind: ocr`, reward/ocr_reward.py): Flow-GRPO's text-rendering rule on text that RapidOCR reads.

Images are rendered here with PIL's bundled font, black on white, 192 x 64 px. The rule is checked apart from the
OCR against a hand-written Levenshtein; the OCR end to end on rendered images, with the network blocked, in process,
and through a Serve reward app over REST on 127.0.0.1.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

import httpx
import numpy as np
import pydantic
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from steadyrl.reward.config import ImageRewardConfig
from steadyrl.reward.factory import JpegSpec, build_reward_model, parse_reward_spec
from steadyrl.reward.ocr_reward import OcrReward, OcrSpec, target_text, text_reward
from tests.helpers import make_testbed
from tests.test_serve_images import model_space, png_b64

W, H = 192, 64
APP, PREFIX = "reward_ocr_test", "/reward_ocr_test"
# (text drawn, prompt): the exact text, another case, one letter wrong, the target inside more text, a wrong word,
# and nothing drawn
CASES = [("OPEN", 'A storefront sign that says "OPEN"'), ("Hello", 'A coffee mug printed with "HELLO"'),
         ("OPEM", 'A storefront sign that says "OPEN"'), ("OPEN NOW", 'A storefront sign that says "OPEN"'),
         ("ZEBRA", 'A storefront sign that says "OPEN"'), ("", 'A storefront sign that says "OPEN"')]


def drawn(text: str, size: int = 36) -> torch.Tensor:
    """`text` centred in black on white with PIL's bundled font, as uint8 [3, H, W] ('' draws nothing)."""
    im = Image.new("RGB", (W, H), "white")
    draw = ImageDraw.Draw(im)
    if text:
        font = ImageFont.load_default(size=size)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        draw.text(((W - right - left) / 2, (H - bottom - top) / 2), text, fill="black", font=font)
    return torch.from_numpy(np.array(im)).permute(2, 0, 1)


@pytest.fixture(scope="module")
def ocr() -> OcrReward:
    return build_reward_model(OcrSpec())


@pytest.fixture(scope="module")
def cases() -> tuple[torch.Tensor, list[str]]:
    return torch.stack([drawn(text) for text, _ in CASES]), [prompt for _, prompt in CASES]


# ------------------------------------------------------------------------------- the rule, apart from the OCR


def levenshtein(a: str, b: str) -> int:
    """Unit-cost edit distance (insert, delete, substitute), the reference for rapidfuzz's."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def reference_reward(recognised: str, target: str) -> float:
    """flow_grpo/ocr.py's rule: spaces out, lower case; d = 0 if the target is in the text read, else the edit
    distance; r = 1 - min(d, |t|) / |t|."""
    s, t = recognised.replace(" ", "").lower(), target.replace(" ", "").lower()
    d = 0 if t in s else levenshtein(s, t)
    return 1 - min(d, len(t)) / len(t)


RULE = [("OPEN", "OPEN", 1.0), ("open", "OPEN", 1.0), ("O P E N", "open", 1.0), ("0PEN", "OPEN", 0.75),
        ("OPNE", "OPEN", 0.5), ("xxOPENyy", "OPEN", 1.0), ("", "OPEN", 0.0), ("completely different", "OPEN", 0.0),
        ("HELO", "HELLO", 0.8), ("HAPPYBIRTHDAY", "Happy Birthday", 1.0), ("HAPPY BIRTHDY", "HAPPY BIRTHDAY", 12 / 13)]


@pytest.mark.parametrize("recognised, target, expected", RULE)
def test_rule_gives_flow_grpos_reward_on_known_strings(recognised, target, expected):
    assert text_reward(recognised, target) == pytest.approx(expected, abs=1e-12)
    assert text_reward(recognised, target) == pytest.approx(reference_reward(recognised, target), abs=1e-12)


def test_rule_equals_the_reference_on_random_strings():
    rng = random.Random(0)
    for _ in range(500):
        t = "".join(rng.choice("abC ") for _ in range(rng.randint(1, 6))).strip() or "a"
        s = "".join(rng.choice("aBc d") for _ in range(rng.randint(0, 9)))
        r = text_reward(s, t)
        assert r == pytest.approx(reference_reward(s, t), abs=1e-12), (s, t)
        assert 0.0 <= r <= 1.0


def test_target_is_the_text_in_the_first_pair_of_double_quotes():
    assert target_text('A sign that says "OPEN"') == "OPEN"
    assert target_text('Two signs, "LEFT" and "RIGHT"') == "LEFT"
    assert target_text('"HAPPY BIRTHDAY" on a cake') == "HAPPY BIRTHDAY"
    for prompt in ("a cat", 'a lone " quote', "single 'quotes'"):
        with pytest.raises(ValueError, match="'mine'.*has none") as err:
            target_text(prompt, "mine")
        assert repr(prompt) in str(err.value)
    with pytest.raises(ValueError, match="empty"):
        target_text('an empty sign " "', "mine")


def test_every_prompt_of_the_shipped_text_rendering_set_quotes_a_target():
    from steadyrl.rollout.prompts import PromptsConfig, build_splits, load_prompt_set

    prompts = load_prompt_set("text_rendering").prompts
    targets = [target_text(p) for p in prompts]
    assert 50 <= len(prompts) <= 100 and len(set(targets)) == len(targets)
    assert all(t == t.strip() and 1 <= len(t) <= 20 for t in targets)
    splits = build_splits(PromptsConfig(train="text_rendering"))
    assert len(splits.train) + len(splits.eval) == len(prompts)


# ------------------------------------------------------------------------------------- the spec and the factory


def test_spec_parses_by_kind_and_names_a_bad_field():
    assert parse_reward_spec({"kind": "ocr"}) == OcrSpec()
    assert parse_reward_spec({"kind": "ocr", "name": "text", "threads": 2}).threads == 2
    for bad, field in (({"kind": "ocr", "min_confidence": 2}, "min_confidence"),
                       ({"kind": "ocr", "lang": "en"}, "lang"),
                       ({"kind": "ocr", "threads": 0}, "threads")):
        with pytest.raises(pydantic.ValidationError, match=field):
            parse_reward_spec(bad)
    cfg = ImageRewardConfig.model_validate({"models": [{"kind": "ocr"}, {"kind": "jpeg", "upscale": 1}],
                                            "monitor_only": ["jpeg_compressibility"]})
    assert [m.kind for m in cfg.trained_specs()] == ["ocr"] and cfg.feature_model_name() is None


def test_a_missing_extra_is_an_error_naming_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"pip install steadyrl\[ocr\]"):
        build_reward_model(OcrSpec())


def test_the_ocr_models_are_files_of_the_installed_package():
    import rapidocr_onnxruntime

    models = sorted(p.name for p in (Path(rapidocr_onnxruntime.__file__).parent / "models").glob("*.onnx"))
    assert any("det" in m for m in models) and any("rec" in m for m in models), models


# ------------------------------------------------------------------------------------------- OCR in process


def test_rendered_text_scores_by_how_well_it_reads(ocr, cases):
    px, prompts = cases
    scores = ocr.score(model_space(px), prompts)
    assert scores.dtype == torch.float32 and scores.shape == (len(CASES),)
    exact, other_case, one_wrong, inside, wrong, blank = scores.tolist()
    assert exact >= 0.9 and other_case >= 0.9 and inside >= 0.9  # case and extra text around it cost nothing
    assert 0.5 <= one_wrong < 1.0  # 'OPEM' for 'OPEN': one edit in four, 0.75 when read exactly
    assert wrong <= 0.25
    assert blank == 0.0


def test_a_prompt_without_a_quoted_text_is_an_error_naming_the_reward_and_prompt(ocr, cases):
    px, prompts = cases
    with pytest.raises(ValueError, match=r"'ocr'.*'a storefront sign'"):
        ocr.score(model_space(px[:2]), [prompts[0], "a storefront sign"])


def test_health_probe_scores_finitely(ocr):
    samples, prompts = ocr.health_probe()
    out = ocr.score(samples, prompts)
    assert out.shape == (1,) and bool(out.isfinite().all()) and out.item() >= 0.9


@pytest.fixture()
def no_network(monkeypatch) -> list:
    """Outbound connections refused (anything but 127.0.0.1, ::1 and unix sockets) and remote names unresolved;
    returns the attempts."""
    attempts: list = []
    local = ("127.0.0.1", "::1", "localhost")

    def allowed(sock: socket.socket, address) -> bool:
        return sock.family == socket.AF_UNIX or (isinstance(address, tuple) and address[0] in local)

    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def connect(self, address):
        if not allowed(self, address):
            attempts.append(address)
            raise OSError(f"network blocked by the test: connect to {address!r}")
        return real_connect(self, address)

    def connect_ex(self, address):
        if not allowed(self, address):
            attempts.append(address)
            return 101  # ENETUNREACH
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in local and host is not None:
            attempts.append(host)
            raise socket.gaierror(f"network blocked by the test: resolve {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


def test_builds_and_scores_with_the_network_blocked(no_network, cases, ocr):
    with socket.socket() as s, pytest.raises(OSError):  # the block itself holds
        s.connect(("192.0.2.1", 80))
    with pytest.raises(OSError):
        socket.getaddrinfo("example.com", 443)
    assert no_network == [("192.0.2.1", 80), "example.com"]
    no_network.clear()
    model = build_reward_model(OcrSpec(name="offline"))  # loads its models: from the wheel, nothing fetched
    px, prompts = cases
    out = model.score(model_space(px), prompts)
    assert no_network == []
    assert torch.equal(out, ocr.score(model_space(px), prompts))
    assert out[0].item() >= 0.9 and out[-1].item() == 0.0


# ------------------------------------------------------------------------------ through Serve, over REST


@pytest.fixture(scope="module")
def ocr_url(serve_port):
    """A text_to_image reward app training on the OCR reward, with a JPEG model watching."""
    from ray import serve

    from steadyrl.services.serving import deploy_reward_app
    from steadyrl.services.testbeds import TextToImageSettings

    cfg = ImageRewardConfig(models=[OcrSpec(), JpegSpec(name="jpeg", upscale=1)], monitor_only=["jpeg"])
    deploy_reward_app(make_testbed(TextToImageSettings(pretrained="not-loaded-by-the-reward-app", prompts={
        "train": "text_rendering"}, reward=cfg)), name=APP, route_prefix=PREFIX)
    yield f"http://127.0.0.1:{serve_port}{PREFIX}"
    serve.delete(APP)


@pytest.mark.slow
def test_rest_scores_equal_the_in_process_reward(ocr_url, ocr, cases):
    px, prompts = cases
    body = {"kind": "text_to_image", "samples": [{"image": png_b64(img), "prompt": p} for img, p in zip(px, prompts)]}
    resp = httpx.post(f"{ocr_url}/v1/score", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    ref = ocr.score(model_space(px), prompts).tolist()
    assert out["names"] == ["ocr"] and [row[0] for row in out["scores"]] == ref
    assert out["reward"] == ref and set(out["monitors"]) == {"jpeg"}
    assert ref[0] >= 0.9 and ref[-1] == 0.0
    models = httpx.get(f"{ocr_url}/v1/models", timeout=60).json()["models"]
    assert [(m["name"], m["kind"], m["role"]) for m in models] == [("ocr", "ocr", "member"),
                                                                  ("jpeg", "jpeg", "monitor")]
