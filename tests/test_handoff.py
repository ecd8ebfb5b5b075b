"""What passes through the driver: batches go rollout worker -> learner through the object store, and the driver
fetches summaries and metrics only (`services.runtime.driver_bytes`, logged per step as `handoff/*`)."""
from __future__ import annotations

import ray
import torch

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.digits import NUM_CLASSES
from steadyrl.services.config import CONFIG_DIR, load_config
from steadyrl.services.run_folder.metrics import read_metrics
from steadyrl.services.runtime.driver_bytes import DriverBytes, value_bytes
from tests.helpers import SMOKE_SHORT


def sample_bytes(overrides: list[str]) -> int:
    """nbytes of one step's `batch.samples` on the digits testbed: every class, group_size samples of each,
    channels x sample_size^2 float32 pixels."""
    cfg = load_config(CONFIG_DIR / "smoke.yaml", overrides)
    unet = cfg.testbed.model
    return NUM_CLASSES * cfg.sampler.group_size * unet.channels * unet.sample_size ** 2 * 4


def test_value_bytes_counts_tensors_by_nbytes_inside_containers_and_dataclasses():
    b, t = 6, 4
    batch = RolloutBatch(cond=torch.zeros(b, dtype=torch.long), group=torch.zeros(b, dtype=torch.long),
                         samples=torch.zeros(b, 1, 8, 8), traj=torch.zeros(b, t + 1, 1, 8, 8),
                         old_logp=torch.zeros(b, t), timesteps=torch.zeros(t, dtype=torch.long),
                         trainable=torch.ones(t, dtype=torch.bool))
    tensors = sum(v.numel() * v.element_size() for v in (batch.cond, batch.group, batch.samples, batch.traj,
                                                         batch.old_logp, batch.timesteps, batch.trainable))
    total, tensor = value_bytes({"batch": batch, "metrics": [1.0, 2.0]})
    assert tensor == tensors and total > tensors  # keys, floats, None fields and names add their pickles
    total, tensor = value_bytes({"reward/train_mean": 0.5, "n": 40.0})
    assert tensor == 0 and 0 < total < 200
    counter = DriverBytes()  # an evaluation's fetch is kept apart from the steps' figures
    evaluation = {"grid": torch.zeros(10, 8, 8), "held_out": 0.5}
    counter.fetched(evaluation)
    counter.evaluated(3)
    assert counter.evaluations == [{"step": 3, "bytes": value_bytes(evaluation)[0], "tensor_bytes": 10 * 8 * 8 * 4}]
    assert counter.take()["handoff/driver_bytes"] == 0


def test_driver_bytes_sees_fetches_and_batches_ray_inlined_into_the_driver(ray_cluster):
    """A worker's (batch, summary) pair as the rollout workers return it: a batch under Ray's 100 KB inline
    limit reaches the driver in the task's reply and is counted as inlined; one above it stays in the object
    store; a fetched batch counts its tensor bytes."""

    @ray.remote
    class Worker:
        @ray.method(num_returns=2)
        def generate(self, nbytes: int) -> tuple[torch.Tensor, dict[str, float]]:
            return torch.zeros(nbytes, dtype=torch.uint8), {"n": 1.0}

    worker = Worker.remote()
    small, small_summary = worker.generate.remote(10_000)
    big, big_summary = worker.generate.remote(1_000_000)
    counter = DriverBytes()
    counter.fetched(ray.get([small_summary, big_summary]))
    counter.batch_refs([small, big])
    first = counter.take()
    assert first["handoff/driver_tensor_bytes"] == first["handoff/driver_inlined_bytes"]
    assert 10_000 <= first["handoff/driver_inlined_bytes"] < 20_000  # the small batch, serialized
    assert first["handoff/batch_bytes"] >= 1_010_000
    assert 10_000 < first["handoff/driver_bytes"] < 20_000
    counter.fetched(ray.get(big))  # someone fetching a batch into the driver
    assert counter.take()["handoff/driver_tensor_bytes"] == 1_000_000
    assert counter.take()["handoff/driver_bytes"] == 0  # take starts again at 0
    ray.kill(worker)


def test_a_ray_runs_batches_never_pass_through_the_driver(smoke_straight):
    """The smoke run through Ray actors, Serve and DeepSpeed (tests/conftest.py's `smoke_straight`): each step
    the driver fetched under 1/100 of the step's sample tensors' bytes in tensors (none, in fact), while the
    batches it handed on by reference weighed more than the samples alone."""
    samples = sample_bytes(SMOKE_SHORT)
    rows = read_metrics(smoke_straight.run_dir)
    assert len(rows) == 6
    for r in rows:
        assert r["handoff/driver_tensor_bytes"] < samples / 100, r
        assert r["handoff/driver_inlined_bytes"] == 0, r
        assert r["handoff/batch_bytes"] > samples, r  # samples, trajectories, log-probs, rewards...
        assert 0 < r["handoff/driver_bytes"] < r["handoff/batch_bytes"] / 10, r  # summaries and metrics
        assert r["handoff/cross_node_batch_bytes"] == r["handoff/cross_node_weight_bytes"] == 0, r  # one node
