"""DiffusionNFT and GARDO-NFT sample with their old (EMA) policy, as the authors' scripts do (set_adapter("old")
before sampling): the learner's `sampling_weights` are the old copy's tensors (LoRA: its adapters), the local
runtime's rollouts hold them after a publish, and the Ray runtime computes the same run bitwise."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from steadyrl.services.config import CONFIG_DIR, load_config
from steadyrl.trainer.objectives.diffusion_nft import DiffusionNFTCodeSettings
from tests.helpers import computed_metrics, tiny_sd3_nft_learner, train_local

NFT = CONFIG_DIR / "digits-flow-nft.yaml"
SHORT = ["run.steps=2", "run.eval_every=2", "run.checkpoint_every=2", "sampler.group_size=4",
         "testbed.eval_samples_per_class=2", "learner.micro_batch_size=20", "learner.inner_epochs=1"]


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def test_lora_learner_publishes_the_old_adapters_for_sampling(tmp_path):
    """Before the first update the old copy is the policy; after it old = d old_0 + (1 - d) theta (d = 0.001) and
    the sampling weights are exactly those adapters, not the trained ones."""
    learner, batch = tiny_sd3_nft_learner(tmp_path, DiffusionNFTCodeSettings())
    start = learner.weights()
    assert equal(learner.sampling_weights(), start)
    learner.update(batch)
    trained, sampling = learner.weights(), learner.sampling_weights()
    assert all("lora" in k for k in sampling) and sampling.keys() == trained.keys()
    assert not equal(sampling, trained)
    assert equal(sampling, {k: v.cpu() for k, v in learner.objective.old.state.items()})
    for k, v in sampling.items():  # independent of the objective's own EMA code: the schedule's first value
        torch.testing.assert_close(v, 0.001 * start[k] + 0.999 * trained[k])


def test_sample_with_current_publishes_the_trained_adapters(tmp_path):
    learner, batch = tiny_sd3_nft_learner(tmp_path, DiffusionNFTCodeSettings(sample_with="current"))
    learner.update(batch)
    assert equal(learner.sampling_weights(), learner.weights())


def test_the_local_runtime_samples_with_the_old_policy_after_a_publish():
    """services/runtime/local_runtime.py: after an update and its publish, the rollouts' policy holds the old copy."""
    from steadyrl.rollout.policy import trainable_state
    from steadyrl.services.runtime.local_runtime import LocalLearner, LocalRolloutPool, LocalScorer
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(NFT, [*SHORT, "run.runtime=local", "run.progress=false"])
    testbed = build_testbed(cfg)
    testbed.preflight()
    base = load_file(str(testbed.base_weights(progress=False)))
    testbed.prepare_rewards(None)
    learner = LocalLearner(cfg, base)
    learner.start()
    pool = LocalRolloutPool(cfg, base, learner, LocalScorer(testbed.reward_ensemble()))
    pool.launch(1)
    batches, _ = pool.collect(1)
    learner.update(batches)
    pool.publish(1)
    trainer = learner.learner
    held = trainable_state(pool.rollouts.policy)
    assert equal(held, {k: v for k, v in trainer.objective.old.state.items()})
    assert not equal(held, trainer.weights())


@pytest.mark.usefixtures("ray_cluster")
def test_the_ray_runtime_samples_what_the_local_runtime_samples(tmp_path):
    """Two DiffusionNFT steps through Ray actors and through `--local`: step 2 samples with the weights published
    after step 1 (the old copy on both), so its rewards, the evaluation and the checkpoint agree bitwise."""
    from steadyrl.services.driver.controller import train
    from steadyrl.services.run_folder.metrics import read_metrics

    local, local_rows = train_local(NFT, tmp_path / "local", SHORT)
    on_ray = train(NFT, [f"run.run_dir={tmp_path / 'ray'}", "run.progress=false", *SHORT])
    assert computed_metrics(read_metrics(on_ray.run_dir)) == computed_metrics(local_rows)
    mine = load_file(str(local.run_dir / "checkpoints" / "step_2" / "policy.safetensors"))
    theirs = load_file(str(on_ray.run_dir / "checkpoints" / "step_2" / "policy.safetensors"))
    assert equal(mine, theirs)
