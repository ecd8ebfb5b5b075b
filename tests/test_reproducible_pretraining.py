"""Every pre-trained artefact (the digits UNets, the reward classifiers, the arith masked LM, causal LM and
block-diffusion LM) comes out bitwise the same whatever the thread count of the process that builds it: the cache a fresh machine fills is the cache
every other machine has."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# Builds each artefact small (a few iterations) and prints a digest of its weights. The thread count is set
# twice over: by OMP_NUM_THREADS at process start and by torch.set_num_threads after import.
BUILD_ALL = r"""
import hashlib, json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from steadyrl.reward.classifiers import train_classifier
from steadyrl.reward.config import RewardConfig
from steadyrl.rollout.arith import ArithTask
from steadyrl.rollout.block_diffusion_lm import BlockDiffusionLMConfig
from steadyrl.rollout.causal_lm import CausalLMConfig
from steadyrl.rollout.config import SchedulerConfig, UNetConfig
from steadyrl.rollout.masked_lm import MaskedLMConfig
from steadyrl.services.testbeds.arith.pretrain_block_diffusion import BlockDiffusionPretrainConfig, pretrain_block_diffusion_lm
from steadyrl.services.testbeds.arith.pretrain_causal_lm import CausalLMPretrainConfig, pretrain_causal_lm
from steadyrl.services.testbeds.arith.pretrain_masked_lm import MaskedLMPretrainConfig, pretrain_masked_lm
from steadyrl.services.testbeds.digits.pretrain import PretrainConfig, pretrain_unet

def digest(model):
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode()); h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()

unet_cfg, sched = UNetConfig(), SchedulerConfig()
out = {
    "threads": torch.get_num_threads(),
    "epsilon_unet": digest(pretrain_unet(unet_cfg, sched, PretrainConfig(iterations=6), progress=False)[0]),
    "flow_unet": digest(pretrain_unet(unet_cfg, sched, PretrainConfig(iterations=6), progress=False,
                                      prediction="velocity")[0]),
    "classifier": digest(train_classifier(RewardConfig().members[0].model_copy(update={"epochs": 2}))[0]),
    "masked_lm": digest(pretrain_masked_lm(ArithTask(), MaskedLMConfig(), MaskedLMPretrainConfig(iterations=30),
                                           progress=False)[0]),
    "causal_lm": digest(pretrain_causal_lm(ArithTask(), CausalLMConfig(), CausalLMPretrainConfig(iterations=10),
                                           progress=False)[0]),
    "block_diffusion_lm": digest(pretrain_block_diffusion_lm(ArithTask(), BlockDiffusionLMConfig(), 4,
                                                             BlockDiffusionPretrainConfig(iterations=6),
                                                             progress=False)[0]),
    "threads_after": torch.get_num_threads(),
}
print(json.dumps(out))
"""


def build_in_subprocess(threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", BUILD_ALL, str(threads)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_pretrained_weights_are_bitwise_the_same_on_one_and_two_threads():
    one, two = build_in_subprocess(1), build_in_subprocess(2)
    assert (one["threads"], two["threads"]) == (1, 2)
    assert (one["threads_after"], two["threads_after"]) == (1, 2)  # the caller's thread count is restored
    for artefact in ("epsilon_unet", "flow_unet", "classifier", "masked_lm", "causal_lm"):
        assert one[artefact] == two[artefact], artefact


def test_reproducible_build_leaves_the_global_rng_and_threads_as_they_were():
    from steadyrl.rollout.cache import reproducible_build

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    with reproducible_build(7) as gen:
        assert torch.get_num_threads() == 1
        inside = torch.rand(2, generator=gen)
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads
    with reproducible_build(7) as gen:
        assert torch.equal(torch.rand(2, generator=gen), inside)
