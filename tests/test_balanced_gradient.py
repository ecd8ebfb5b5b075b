"""BGPO seed-form pieces (trainer/balanced_gradient.py, trainer/dual_momentum.py): each piece's defining
property against an independent computation."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from steadyrl.rollout.config import UNetConfig
from steadyrl.rollout.models import build_unet
from steadyrl.trainer.balanced_gradient import (
    BalancedGradientConfig,
    DualMomentum,
    RollingQuantileClipper,
    apply_module_precision,
    enable_activation_checkpointing,
    scale_module_gradients,
)

torch.set_num_threads(1)


def tiny_bert(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, hidden_dropout_prob=0, attention_probs_dropout_prob=0)
    return BertForMaskedLM(cfg).to(dtype)


def tiny_unet(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_unet(UNetConfig(block_out_channels=(8, 16), norm_num_groups=4)).to(dtype)


def bert_ids() -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))


def unet_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 1, 8, 8, generator=g, dtype=dtype), torch.tensor([10, 500]), torch.tensor([3, 7])


# ------------------------------------------------------------------------------------------------ config
def test_config_defaults_off_and_validation():
    cfg = BalancedGradientConfig()
    assert not (cfg.module_grad_scaling or cfg.dual_momentum or cfg.advantage_quantile_clip
                or cfg.activation_checkpointing or cfg.module_precision)
    assert BalancedGradientConfig(module_precision={"bert.encoder": "bf16"}).module_precision == {"bert.encoder": "bf16"}
    for bad in ({"short_horizon": 200.0}, {"module_precision": {"x": "int8"}}, {"quantile": 1.5}, {"typo": 1}):
        with pytest.raises(ValidationError):
            BalancedGradientConfig(**bad)


# ------------------------------------------------------------------------------------------------ gradient scaling
class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))  # group 'a.0', 'a.1' at depth 2
        self.b = nn.Linear(5, 2)  # group 'b'
        self.frozen = nn.Linear(2, 2)  # no grad: skipped
        self.root = nn.Parameter(torch.ones(3))  # group ''


def test_scale_module_gradients_norms_and_directions():
    torch.manual_seed(0)
    model = Nested().double()
    for i, (name, p) in enumerate(model.named_parameters()):
        if not name.startswith("frozen"):
            p.grad = torch.randn_like(p) * 10.0**(i - 3)  # very different magnitudes across groups
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    scales = scale_module_gradients(model, depth=2, eps=1e-8)

    expected_groups = {"a.0": r"^a\.0\.", "a.1": r"^a\.1\.", "b": r"^b\.", "": r"^root$"}
    assert set(scales) == set(expected_groups)
    for group, pattern in expected_groups.items():
        names = [n for n in before if re.match(pattern, n)]
        g0 = torch.cat([before[n].flatten() for n in names])
        g1 = torch.cat([dict(model.named_parameters())[n].grad.flatten() for n in names])
        d = g0.numel()
        s = d**0.5 / (g0.norm() + 1e-8)
        assert scales[group] == pytest.approx(float(s), rel=1e-12)
        n = g0.norm().item()  # ||g_i|| after = sqrt(d_i) n / (n + eps): sqrt(d_i) up to eps
        assert g1.norm().item() == pytest.approx(d**0.5 * n / (n + 1e-8), rel=1e-12)
        assert g1.norm().item() == pytest.approx(d**0.5, rel=1.01e-8 / n)
        torch.testing.assert_close(g1, g0 * s, rtol=1e-14, atol=0)  # same direction: one positive factor
    assert model.frozen.weight.grad is None


def test_scale_module_gradients_groups_of_a_bert():
    model = tiny_bert(torch.float64)
    model(bert_ids()).logits.square().mean().backward()
    before = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if n.startswith("bert.encoder.")])
    scales = scale_module_gradients(model, depth=2, eps=1e-8)
    assert set(scales) == {"bert.embeddings", "bert.encoder", "cls.predictions"}
    after = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if n.startswith("bert.encoder.")])
    d, n = after.numel(), before.norm().item()
    assert after.norm().item() == pytest.approx(d**0.5 * n / (n + 1e-8), rel=1e-12)
    assert scales["bert.encoder"] == pytest.approx(d**0.5 / (n + 1e-8), rel=1e-12)


# ------------------------------------------------------------------------------------------------ dual momentum
def grads_sequence(shapes: list[tuple[int, ...]], steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(steps)]


def run_optimizer(opt: torch.optim.Optimizer, params: list[nn.Parameter], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def make_params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64)),
            nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64))]


@pytest.mark.parametrize("horizon", [1.0, 10.0])
def test_dual_momentum_equal_horizons_is_adamw(horizon):
    ours, ref = make_params(), make_params()
    grads = grads_sequence([(4, 3), (5,)], steps=8)
    kw = {"lr": 1e-2, "eps": 1e-8, "weight_decay": 0.05}
    run_optimizer(DualMomentum(ours, short_horizon=horizon, long_horizon=horizon, beta2=0.99, **kw), ours, grads)
    run_optimizer(torch.optim.AdamW(ref, betas=(1 - 1 / horizon, 0.99), foreach=False, **kw), ref, grads)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_dual_momentum_matches_formula():
    """Distinct horizons: against the docstring's formula written out in numpy."""
    params = make_params()
    x = [p.detach().numpy().copy() for p in params]
    grads = grads_sequence([(4, 3), (5,)], steps=7, seed=3)
    lr, hs, hl, b2, eps, wd = 3e-2, 3.0, 20.0, 0.95, 1e-8, 0.1
    run_optimizer(DualMomentum(params, lr, hs, hl, b2, eps, wd), params, grads)
    bs, bl = 1 - 1 / hs, 1 - 1 / hl
    for i in range(len(x)):
        ms = ml = v = np.zeros_like(x[i])
        for t, step_grads in enumerate(grads, start=1):
            g = step_grads[i].numpy()
            ms, ml, v = bs * ms + (1 - bs) * g, bl * ml + (1 - bl) * g, b2 * v + (1 - b2) * g * g
            ms_hat, ml_hat, v_hat = ms / (1 - bs**t), ml / (1 - bl**t), v / (1 - b2**t)
            agree = np.sign(ms_hat) == np.sign(ml_hat)
            u = np.where(agree, np.sign(ms_hat) * np.sqrt(np.abs(ms_hat) * np.abs(ml_hat)), 0.0)
            x[i] = x[i] * (1 - lr * wd) - lr * u / (np.sqrt(v_hat) + eps)
        np.testing.assert_allclose(params[i].detach().numpy(), x[i], rtol=0, atol=1e-12)


def test_dual_momentum_sign_disagreement_freezes_element():
    # short horizon 1: m_s = the last gradient; the long momentum still remembers the big first gradient
    p = nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
    opt = DualMomentum([p], lr=0.1, short_horizon=1, long_horizon=100)
    p.grad = torch.tensor([10.0, 1.0], dtype=torch.float64)
    opt.step()
    after_first = p.detach().clone()
    p.grad = torch.tensor([-1.0, 1.0], dtype=torch.float64)  # element 0: m_s < 0 < m_l
    opt.step()
    st = opt.state[p]
    assert st["m_short"][0] < 0 < st["m_long"][0]
    assert p[0].item() == after_first[0].item()  # no update where the momenta disagree
    assert p[1].item() < after_first[1].item()  # agreeing element keeps moving


def test_dual_momentum_state_round_trip():
    grads = grads_sequence([(4, 3), (5,)], steps=6, seed=5)
    a = make_params()
    opt_a = DualMomentum(a, lr=1e-2, short_horizon=3, long_horizon=30, weight_decay=0.01)
    run_optimizer(opt_a, a, grads[:3])
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_b = DualMomentum(b, lr=1e-2, short_horizon=3, long_horizon=30, weight_decay=0.01)
    buf.seek(0)
    opt_b.load_state_dict(torch.load(buf))
    run_optimizer(opt_a, a, grads[3:])
    run_optimizer(opt_b, b, grads[3:])
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)
        for key in ("step", "m_short", "m_long", "v"):
            assert torch.equal(opt_a.state[pa][key], opt_b.state[pb][key])


# ------------------------------------------------------------------------------------------------ quantile clipping
def test_rolling_quantile_clipper_matches_numpy():
    rng = np.random.default_rng(0)
    clip = RollingQuantileClipper(quantile=0.9, window=50)
    seen: list[float] = []
    for size in (7, 20, 1, 33, 80, 5, 49):  # crosses the window several times, one batch larger than it
        adv = rng.standard_t(df=2, size=size)  # heavy tails: the clip bites
        seen.extend(np.abs(adv))
        q = np.quantile(np.array(seen[-50:]), 0.9)  # numpy's default: linear interpolation
        out = clip(torch.from_numpy(adv))
        np.testing.assert_allclose(out.numpy(), np.clip(adv, -q, q), rtol=0, atol=1e-14)
        assert clip.last_q == pytest.approx(q, abs=1e-14)
        np.testing.assert_array_equal(clip.history().numpy(), np.array(seen[-50:]))  # exactly the last window
    assert int(clip.count) == len(seen)


def test_rolling_quantile_clipper_state_round_trip():
    a = RollingQuantileClipper(0.8, window=16)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        a(torch.randn(7, generator=g))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = RollingQuantileClipper(0.8, window=16)
    b.load_state_dict(torch.load(buf))
    adv = 3 * torch.randn(9, generator=g)
    assert torch.equal(a(adv), b(adv))
    assert torch.equal(a.history(), b.history())
    with pytest.raises(ValueError, match="window"):
        RollingQuantileClipper(0.8, window=8).load_state_dict(a.state_dict())


# ------------------------------------------------------------------------------------------------ activation checkpointing
def count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def grads_with_and_without_checkpointing(build, forward, probe):
    plain, ckpt = build(), build()
    assert enable_activation_checkpointing(ckpt) is True
    out = {}
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        model.train()
        calls = count_calls(probe(model))
        forward(model).square().mean().backward()
        out[name] = ({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, calls[0])
    (g_plain, calls_plain), (g_ckpt, calls_ckpt) = out["plain"], out["ckpt"]
    assert (calls_plain, calls_ckpt) == (1, 2)  # the probed block really is recomputed in backward
    assert g_plain.keys() == g_ckpt.keys() and len(g_plain) == len(list(plain.parameters()))
    for n in g_plain:
        torch.testing.assert_close(g_ckpt[n], g_plain[n], rtol=0, atol=1e-10)


def test_activation_checkpointing_bert_same_gradients():
    grads_with_and_without_checkpointing(lambda: tiny_bert(torch.float64), lambda m: m(bert_ids()).logits,
                                         lambda m: m.bert.encoder.layer[0].output.dense)


def test_activation_checkpointing_unet_same_gradients():
    x, t, c = unet_inputs(torch.float64)
    grads_with_and_without_checkpointing(lambda: tiny_unet(torch.float64), lambda m: m(x, t, class_labels=c).sample,
                                         lambda m: m.down_blocks[0].resnets[0].conv1)


def test_activation_checkpointing_unsupported_model():
    with pytest.raises(ValueError, match="Linear"):
        enable_activation_checkpointing(nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------ module precision
def test_module_precision_bert_encoder_bf16():
    ref, model = tiny_bert(), tiny_bert()
    assert apply_module_precision(model, {"bert.encoder": "bf16"}) == {"bert.encoder": torch.bfloat16}
    for n, p in model.named_parameters():
        assert p.dtype == (torch.bfloat16 if n.startswith("bert.encoder.") else torch.float32), n
    logits = model(bert_ids()).logits
    assert logits.dtype == torch.float32
    logits.square().mean().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, n
    expected = ref(bert_ids()).logits
    assert ((logits - expected).norm() / expected.norm()).item() < 0.05


def test_module_precision_nested_and_module_lists():
    model = tiny_bert()
    hooked = apply_module_precision(model, {"bert.encoder.layer.0": "fp32", "bert.encoder.layer": "bf16"})
    # a ModuleList has no forward: its children are hooked; the deeper entry overrides the enclosing one
    assert hooked == {"bert.encoder.layer.0": torch.float32, "bert.encoder.layer.1": torch.bfloat16}
    assert model.bert.encoder.layer[0].output.dense.weight.dtype == torch.float32
    assert model.bert.encoder.layer[1].output.dense.weight.dtype == torch.bfloat16
    logits = model(bert_ids()).logits
    assert logits.dtype == torch.float32
    logits.square().mean().backward()
    apply_module_precision(model, {"bert.encoder.layer.1": "fp16"})  # hooked again: the casts still nest (LIFO)
    assert model(bert_ids()).logits.dtype == torch.float32
    with pytest.raises(ValueError, match="'bert.nope'"):
        apply_module_precision(tiny_bert(), {"bert.nope": "bf16"})


def test_module_precision_unet_down_blocks_bf16():
    ref, model = tiny_unet(), tiny_unet()
    apply_module_precision(model, {"down_blocks": "bf16"})
    x, t, c = unet_inputs(torch.float32)
    out = model(x, t, class_labels=c).sample
    assert out.dtype == torch.float32 and model.down_blocks[0].resnets[0].conv1.weight.dtype == torch.bfloat16
    out.square().mean().backward()
    expected = ref(x, t, class_labels=c).sample
    assert ((out - expected).norm() / expected.norm()).item() < 0.05
