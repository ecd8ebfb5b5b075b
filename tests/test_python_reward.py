"""A user's reward function by import path (`kind: python`, reward/python_reward.py): it resolves when the
config loads, sees the images as uint8 arrays and the prompts as given, is built once as a class, fails with its
own message, and scores a training run through the Serve ensemble exactly as in one process."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch

from steadyrl.reward.factory import build_reward_model, parse_reward_spec
from steadyrl.reward.python_reward import RewardFunctionError
from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config
from steadyrl.services.driver.controller import train
from steadyrl.services.run_folder.metrics import read_metrics
from tests.helpers import SMOKE_SHORT, computed_metrics

USER_REWARDS = '''
import numpy as np

def brightness(images, prompts, scale=1.0):
    """Mean pixel value in [0, 1], times `scale`."""
    return [scale * float(np.asarray(im, dtype=np.float64).mean()) / 255 for im in images]

def sized_brightness(images, prompts):
    """Called on one prompt group: the group's size plus each image's brightness in [0, 1]."""
    return [len(images) + float(np.asarray(im, dtype=np.float64).mean()) / 255 for im in images]

def first_unscored(images, prompts):
    """Called per group: NaN for the group's first image (one it could not score), brightness for the rest."""
    return [float("nan")] + [float(np.asarray(im, dtype=np.float64).mean()) / 255 for im in images[1:]]

CALLS = []

def two_scores(images, prompts):
    """Named scores: brightness and darkness in [0, 1] (each call recorded)."""
    CALLS.append(len(images))
    bright = [float(np.asarray(im, dtype=np.float64).mean()) / 255 for im in images]
    return {"bright": bright, "dark": [1 - b for b in bright], "unused": [0.0] * len(images)}

def asked_count(images, prompts, metadata):
    """A GenEval-style reward: the count the prompt's metadata asks for, minus a tenth of the brightness."""
    return [m.get("count", -1) - float(np.asarray(im, dtype=np.float64).mean()) / 2550
            for im, m in zip(images, metadata)]

def echo_labels(images, prompts):
    return [float(p) for p in prompts]

def broken(images, prompts):
    raise KeyError("no such font")

def short(images, prompts):
    return [1.0] * (len(images) - 1)

def words(images, prompts):
    return ["high"] * len(images)

def close_to_answer(completions, prompts, answers):
    """Text: 1 for the reference answer, else minus the distance of the number to it (non-numbers: -100)."""
    out = []
    for c, a in zip(completions, answers):
        out.append(float(-abs(int(c) - int(a))) if c.isdigit() and a is not None else -100.0)
    return out

class Counted:
    built = 0

    def __init__(self, offset):
        Counted.built += 1
        self.offset = offset

    def __call__(self, images, prompts):
        return [self.offset + im.shape[0] for im in images]
'''


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(textwrap.dedent(USER_REWARDS))
    return path


def model(path, attr, **kw):
    return build_reward_model(parse_reward_spec({"kind": "python", "name": attr, "function": f"{path}:{attr}", **kw}))


def test_the_function_sees_uint8_images_decoded_from_minus_one_to_one_and_the_prompts_as_given(rewards_file):
    samples = torch.tensor([[[[-1.0, 1.0], [0.0, 0.5]]], [[[1.0, 1.0], [1.0, 1.0]]]])  # [2, 1, 2, 2]
    pixels = np.round((samples.numpy() + 1) * 127.5)  # 0, 255, 128 (127.5 rounds to even), 191
    want = pixels.reshape(2, -1).mean(axis=1) / 255 * 2
    got = model(rewards_file, "brightness", settings={"scale": 2.0}).score(samples, torch.tensor([3, 7]))
    assert got.dtype == torch.float32 and torch.equal(got, torch.tensor(want, dtype=torch.float32))
    assert model(rewards_file, "echo_labels").score(samples, torch.tensor([3, 7])).tolist() == [3.0, 7.0]


def test_a_class_is_built_once_with_its_settings_and_then_called_per_batch(rewards_file):
    reward = model(rewards_file, "Counted", settings={"offset": 10})
    module = __import__("sys").modules[type(reward.call).__module__]
    for _ in range(3):
        assert reward.score(torch.zeros(2, 3, 4, 4), ["a", "b"]).tolist() == [14.0, 14.0]  # offset + H
    assert module.Counted.built == 1


def test_pil_images_are_given_when_asked(tmp_path):
    path = tmp_path / "pil_reward.py"
    path.write_text("def size(images, prompts):\n    return [im.size[0] * 100 + len(im.mode) for im in images]\n")
    got = model(path, "size", images="pil").score(torch.zeros(2, 3, 5, 4), ["x", "y"])
    assert got.tolist() == [403.0, 403.0]  # width 4, mode "RGB"


@pytest.mark.parametrize("attr,needle", [
    ("broken", r"reward 'broken' \(.*user_rewards.py:broken\) raised KeyError: 'no such font'"),
    ("short", r"reward 'short' .* returned 1 scores .* for 2 samples"),
    ("words", r"reward 'words' .* returned list, not 2 numbers"),
])
def test_a_bad_function_fails_with_its_own_message_and_the_path(rewards_file, attr, needle):
    with pytest.raises(RewardFunctionError, match=needle):
        model(rewards_file, attr).score(torch.zeros(2, 1, 2, 2), torch.tensor([0, 1]))


@pytest.mark.parametrize("function,needle", [
    ("no_such_module_anywhere:score", r"cannot import module 'no_such_module_anywhere'"),
    ("{file}:missing", r"has no attribute 'missing'"),
    ("{dir}/absent.py:score", r"no file .*absent.py"),
    ("just_a_name", r"must be 'module.path:attribute'"),
])
def test_a_path_that_does_not_resolve_fails_when_the_config_loads(rewards_file, function, needle):
    function = function.format(file=rewards_file, dir=rewards_file.parent)
    with pytest.raises(ConfigError, match=needle):
        load_config(CONFIG_DIR / "smoke.yaml", [f"testbed.reward.functions=[{{name: mine, function: '{function}'}}]"])


def test_a_reward_function_trains_through_the_serve_ensemble_exactly_as_in_one_process(rewards_file, tmp_path):
    """The digits run trained on a user's brightness reward (its own column, weighted 1:1 with the CNN
    classifier): the Ray runtime (the function inside a Serve replica) and the local runtime give the same
    metrics and evaluations, bit for bit, and the function's column is logged every step. A groupwise function
    is called once per prompt group, in the Serve replica as in one process."""
    fn, grouped = f"{rewards_file}:brightness", f"{rewards_file}:sized_brightness"
    overrides = [*SMOKE_SHORT, "run.steps=2", "run.checkpoint_every=2", "run.eval_every=2",
                 f"testbed.reward.functions=[{{name: bright, function: '{fn}'}}, "
                 f"{{name: grouped, function: '{grouped}', groupwise: true}}]",
                 "testbed.reward.train_on=weighted",
                 "testbed.reward.weighting={weights: {cnn: 1.0, bright: 1.0, grouped: 0.5}}"]
    local = train(CONFIG_DIR / "smoke.yaml", [f"run.run_dir={tmp_path / 'local'}", "run.runtime=local", *overrides])
    on_ray = train(CONFIG_DIR / "smoke.yaml", [f"run.run_dir={tmp_path / 'ray'}", *overrides])
    rows = read_metrics(local.run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["reward/bright"] < 1 for r in rows)
    assert all(4 < r["reward/grouped"] < 5 for r in rows)  # called per group of 4 (sampler.group_size), not per batch
    assert computed_metrics(rows) == computed_metrics(read_metrics(on_ray.run_dir))
    assert json.loads((local.run_dir / "evals.json").read_text()) == json.loads((on_ray.run_dir / "evals.json")
                                                                                 .read_text())


def test_a_class_whose_settings_fail_is_named_with_its_settings(rewards_file):
    with pytest.raises(ValueError, match=r"reward 'Counted': building .*:Counted with settings \{'offset': 1, "
                                         r"'colour': 'red'\} raised TypeError"):
        model(rewards_file, "Counted", settings={"offset": 1, "colour": "red"})


def test_on_text_to_image_a_function_is_a_member_of_the_image_ensemble_beside_the_built_in_models(rewards_file):
    """`testbed.reward.models` takes `kind: python` beside JPEG: the ensemble scores images [B,3,H,W] with their
    prompt strings, and the function's column is its values."""
    from steadyrl.reward.config import ImageRewardConfig

    cfg = ImageRewardConfig.model_validate({"models": [
        {"kind": "jpeg", "upscale": 1}, {"kind": "python", "name": "bright", "function": f"{rewards_file}:brightness"}],
        "train_on": "bright"})
    images = torch.linspace(-1, 1, 2 * 3 * 8 * 8).reshape(2, 3, 8, 8)
    scores = cfg.ensemble_spec().build().score_all(images, ["a cat", "a dog"])
    want = model(rewards_file, "brightness").score(images, ["a cat", "a dog"])
    assert scores.names == ["jpeg_compressibility", "bright"] and torch.equal(scores.reward, want)
    assert torch.equal(scores.scores[:, 1], want) and bool((want > 0).all())


def test_a_groupwise_function_is_called_once_per_prompt_group_with_that_groups_samples(rewards_file):
    """Groups interleaved in the batch: each call gets one group's samples in batch order; no group ids: one call
    with the whole batch; a pointwise function ignores the groups (`reward.base.score_model`, which the in-process
    ensemble and each Serve replica call)."""
    from steadyrl.reward.base import score_model

    reward = model(rewards_file, "sized_brightness", groupwise=True)
    images = torch.linspace(-1, 1, 5 * 1 * 2 * 2).reshape(5, 1, 2, 2)
    group = torch.tensor([7, 3, 7, 7, 3])
    got = score_model(reward, images, torch.arange(5), group)
    alone = model(rewards_file, "brightness").score(images, torch.arange(5))
    assert torch.allclose(got, alone + torch.tensor([3.0, 2.0, 3.0, 3.0, 2.0]), atol=1e-6, rtol=0)
    assert torch.allclose(score_model(reward, images, torch.arange(5)), alone + 5, atol=1e-6, rtol=0)
    pointwise = model(rewards_file, "sized_brightness")
    assert torch.allclose(score_model(pointwise, images, torch.arange(5), group), alone + 5, atol=1e-6, rtol=0)


def test_a_language_model_function_gets_the_decoded_completions_prompts_and_reference_answers(rewards_file):
    """On arith the testbed gives the function its verifier's decoder: token ids become the completion up to the
    first <eos> and the prompt without its padding; an addition's reference answer is its sum."""
    from steadyrl.reward.verifiers import VerifierSpec
    from steadyrl.rollout.arith import TOKENIZER

    text = VerifierSpec()
    reward = model(rewards_file, "close_to_answer", text=text.model_dump())
    prompts = [TOKENIZER.encode("12+30="), [TOKENIZER.pad_id] + TOKENIZER.encode("5+7=")]
    width = max(map(len, prompts))
    cond = torch.tensor([[TOKENIZER.pad_id] * (width - len(p)) + p for p in prompts])
    samples = torch.tensor([TOKENIZER.encode("42") + [TOKENIZER.eos_id, TOKENIZER.eos_id],
                            TOKENIZER.encode("9") + [TOKENIZER.eos_id] + TOKENIZER.encode("99")])
    assert reward.inputs(samples, cond) == (["42", "9"], ["12+30=", "5+7="], ["42", "12"])
    assert reward.score(samples, cond).tolist() == [0.0, -3.0]
    assert reward.score_items(["12+30=", "5+7="], ["41", "x"])[0].tolist() == [-1.0, -100.0]


def test_on_arith_a_function_is_a_member_beside_the_verifier_and_can_be_what_trains(rewards_file):
    from steadyrl.services.testbeds import build_testbed

    fn = f"{rewards_file}:close_to_answer"
    cfg = load_config(CONFIG_DIR / "arith-grpo.yaml", [f"testbed.functions=[{{name: close, function: '{fn}'}}]",
                                                     "testbed.train_on=close"])
    spec = build_testbed(cfg).reward_spec()
    assert spec.member_names() == ["verifier", "close"] and spec.train_on == "close"
    assert spec.members[1].text == spec.members[0]  # decodes and answers as the verifier does
    for bad, needle in [(["testbed.train_on=nothing"], r"testbed.train_on='nothing' must be"),
                        ([f"testbed.functions=[{{name: exact, function: '{fn}'}}]"], r"not 'verifier' or 'exact'")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(CONFIG_DIR / "arith-grpo.yaml", bad)


def test_an_arith_run_trained_on_a_function_is_the_same_through_serve_and_in_one_process(rewards_file, tmp_path):
    """The dLLM trained on the verifier and a user's text function (weighted 1:1): the Ray runtime (the function in
    a Serve replica, fed token ids) and the local runtime give the same metrics and evaluations, bit for bit."""
    fn = f"{rewards_file}:close_to_answer"
    overrides = ["run.steps=2", "run.eval_every=2", "run.checkpoint_every=2", "run.progress=false",
                 "testbed.prompts_per_step=8", "testbed.eval_problems=40", "serve.port=0",
                 f"testbed.functions=[{{name: close, function: '{fn}'}}]", "testbed.train_on=weighted",
                 "testbed.weighting={weights: {verifier: 1.0, close: 1.0}}"]
    config = CONFIG_DIR / "arith-grpo.yaml"
    local = train(config, [f"run.run_dir={tmp_path / 'local'}", "run.runtime=local", *overrides])
    on_ray = train(config, [f"run.run_dir={tmp_path / 'ray'}", *overrides])
    rows = read_metrics(local.run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward/close"] <= 0 for r in rows)
    assert computed_metrics(rows) == computed_metrics(read_metrics(on_ray.run_dir))
    assert json.loads((local.run_dir / "evals.json").read_text()) == json.loads((on_ray.run_dir / "evals.json")
                                                                                 .read_text())


def test_an_arith_app_scores_text_items_with_a_function_over_rest(rewards_file, serve_port):
    """The REST route of an arith reward app with a function member (real Serve over HTTP on 127.0.0.1): text
    items reach the function with their reference answers, and it trains the app's reward."""
    import httpx
    from ray import serve

    from steadyrl.services.config import ServeConfig
    from steadyrl.services.serving import deploy_reward_app
    from steadyrl.services.testbeds.arith.masked import ArithSettings
    from tests.helpers import make_testbed

    settings = ArithSettings(functions=[{"name": "close", "function": f"{rewards_file}:close_to_answer"}],
                             train_on="close")
    deploy_reward_app(make_testbed(settings), ServeConfig(), name="py-arith", route_prefix="/py-arith")
    try:
        body = {"kind": "arith", "samples": [{"prompt": "07+45=", "completion": "50"},
                                             {"prompt": "1+1=", "completion": "2"}]}
        out = httpx.post(f"http://127.0.0.1:{serve_port}/py-arith/v1/score", json=body, timeout=120).json()
        assert out["names"] == ["verifier", "close"] and out["reward"] == [-2.0, 0.0]
        assert out["monitors"]["exact_correct"] == [0.0, 1.0]
    finally:
        serve.delete("py-arith")


def test_samples_a_function_cannot_score_are_skipped_and_counted_through_serve_as_in_one_process(rewards_file,
                                                                                               tmp_path):
    """A groupwise function returns NaN for the first sample of each of the 10 prompt groups: weighted into the
    training reward, those 10 samples per step are skipped and counted (reward/nonfinite_skipped), the function's
    logged mean is over the samples it scored, and the Ray runtime matches the local one bit for bit."""
    overrides = [*SMOKE_SHORT, "run.steps=2", "run.checkpoint_every=2", "run.eval_every=2",
                 f"testbed.reward.functions=[{{name: partial, function: '{rewards_file}:first_unscored', "
                 "groupwise: true}]", "testbed.reward.train_on=weighted",
                 "testbed.reward.weighting={weights: {cnn: 1.0, partial: 1.0}}"]
    local = train(CONFIG_DIR / "smoke.yaml", [f"run.run_dir={tmp_path / 'local'}", "run.runtime=local", *overrides])
    on_ray = train(CONFIG_DIR / "smoke.yaml", [f"run.run_dir={tmp_path / 'ray'}", *overrides])
    rows = read_metrics(local.run_dir)
    assert [r["reward/nonfinite_skipped"] for r in rows] == [10.0, 10.0]
    assert all(0 < r["reward/partial"] < 1 and np.isfinite(r["reward/train_mean"]) for r in rows)
    assert computed_metrics(rows) == computed_metrics(read_metrics(on_ray.run_dir))


def test_a_function_returning_named_scores_gives_a_column_per_key_from_one_call_per_batch(rewards_file):
    """`keys` turn a function's dict into columns `<name>.<key>` (trained on, weighted, logged like any model's);
    the columns of one batch share one call; a dict without `keys`, or a list with them, is an error naming it."""
    from steadyrl.reward.config import RewardConfig
    from steadyrl.reward.python_reward import resolve

    fn = f"{rewards_file}:two_scores"
    cfg = RewardConfig.model_validate({"functions": [{"name": "light", "function": fn, "keys": ["bright", "dark"]}],
                                       "train_on": "weighted",
                                       "weighting": {"weights": {"cnn": 1.0, "light.dark": 2.0}}})
    assert [m.name for m in cfg.member_specs()][-2:] == ["light.bright", "light.dark"]
    again = RewardConfig.model_validate(cfg.model_dump())  # as the config travels: expanded once, not twice
    assert [m.name for m in again.member_specs()] == [m.name for m in cfg.member_specs()]
    models = [build_reward_model(s) for s in cfg.member_specs()[-2:]]
    calls = resolve(fn).__globals__["CALLS"]
    calls.clear()
    images = torch.linspace(-1, 1, 3 * 8 * 8).reshape(3, 1, 8, 8)
    bright, dark = (m.score(images, torch.arange(3)) for m in models)
    want = model(rewards_file, "brightness").score(images, torch.arange(3))
    assert torch.equal(bright, want) and torch.allclose(dark, 1 - want) and calls == [3]
    assert models[0].score(images.flip(0), torch.arange(3)).tolist() == want.flip(0).tolist() and calls == [3, 3]
    with pytest.raises(RewardFunctionError, match=r"returned a dict of named scores \['bright', 'dark', 'unused'\]: "
                       "list the ones to use in `keys`"):
        model(rewards_file, "two_scores").score(images, torch.arange(3))
    with pytest.raises(RewardFunctionError, match="has keys but returned a list"):
        build_reward_model(parse_reward_spec({"kind": "python", "name": "b", "function": f"{rewards_file}:brightness",
                                              "key": "x"})).score(images, torch.arange(3))
    with pytest.raises(RewardFunctionError, match="returned no score 'glow'"):
        build_reward_model(parse_reward_spec({"kind": "python", "name": "b", "function": fn, "key": "glow"})).score(
            images, torch.arange(3))


def test_a_text_to_image_function_that_asks_for_metadata_gets_each_prompts_from_the_prompt_set(rewards_file,
                                                                                               tmp_path):
    """`metadata: true`: the testbed fills in the .jsonl prompt set's metadata by prompt, and the function gets it
    as a third argument ({} for a prompt without any)."""
    from steadyrl.services.testbeds.text_to_image.testbed import TextToImageSettings
    from tests.helpers import make_testbed

    prompts = tmp_path / "counting.jsonl"
    prompts.write_text('{"prompt": "two cats", "count": 2}\n{"prompt": "three dogs", "count": 3}\n'
                       '{"prompt": "a fox"}\n{"prompt": "four owls", "count": 4}\n')
    settings = TextToImageSettings(pretrained="unused/by-reward-spec", prompts={"train": str(prompts),
                                                                              "eval_fraction": 0.25}, reward={
        "models": [{"kind": "python", "name": "count", "function": f"{rewards_file}:asked_count", "metadata": True}]})
    spec = make_testbed(settings).reward_spec()
    assert spec.members[0].prompt_metadata == {"two cats": {"count": 2}, "three dogs": {"count": 3},
                                               "four owls": {"count": 4}}
    ensemble = spec.build()
    images = -torch.ones(4, 3, 4, 4)  # black: brightness 0
    scores = ensemble.score_all(images, ["three dogs", "a fox", "two cats", "four owls"])
    assert scores.reward.tolist() == [3.0, -1.0, 2.0, 4.0]
