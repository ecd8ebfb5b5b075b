"""Handoff: what passes through the driver per step, object-store throughput against a local copy, and weight-sync
bytes and time, full weights vs LoRA. One process, one local Ray, every figure measured in this run.

    python benchmarks/handoff.py                 # -> benchmarks/results/handoff.json
    python benchmarks/handoff.py --quick         # smoke scale (2 steps, small groups, 3 repeats)

a. driver: a Ray run of the default config (configs/digits-grpo.yaml) through `controller.train`; per step the
   `handoff/*` metrics (`services.runtime.driver_bytes`) against the step's sample-tensor bytes (samples nbytes, from the
   config) and batch bytes (what the learner received by reference). The evaluations' fetches (worker 0's
   grid of samples and summary) are counted apart (`DRIVER_FETCHES.evaluations`).
b. object store: a tensor made by actor A, returned from its method (the path a batch takes) and fetched by actor B,
   timed from A's return to B's `ray.get` done (one host: one clock), against `tensor.clone()` in A's process;
   sizes: the default step's samples, its whole batch (median `handoff/batch_bytes` of a), 16 MB and 256 MB.
c. sync: `sync/bytes` (learner) and `timing_s/sync` (controller: gather on the learner, object store, load on the
   workers) of short Ray runs: the tiny SD3-style pipeline of the tests with LoRA (the default) and with full
   weights (`testbed.lora=null`), and the digits run of a (full weights). Real architectures' bytes are
   benchmarks/lora_sync_bytes.py's (results/lora_sync_bytes.json, cited here, not recomputed).

Medians with spread (min..max) over steps (a, c; the first step is dropped in c: warm-up) and repeats (b).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import torch  # noqa: E402

from steadyrl.rollout.digits import NUM_CLASSES  # noqa: E402
from steadyrl.services.config import CONFIG_DIR, load_config  # noqa: E402
from steadyrl.services.driver.controller import train  # noqa: E402
from steadyrl.services.run_folder.metrics import read_metrics  # noqa: E402
from steadyrl.services.runtime.driver_bytes import DRIVER_FETCHES  # noqa: E402
from steadyrl.services.runtime.ray_session import init_ray  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT = CONFIG_DIR / "digits-grpo.yaml"
MB = 1_000_000


def spread(values: list[float]) -> dict[str, float]:
    """Median and min..max of a measured series."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ------------------------------------------------------------------------------------------- a. the driver
def digits_samples_bytes(overrides: list[str]) -> int:
    """nbytes of one step's `batch.samples` on digits: every class x group_size samples, channels x size^2 float32."""
    cfg = load_config(DEFAULT, overrides)
    unet = cfg.testbed.model
    return NUM_CLASSES * cfg.sampler.group_size * unet.channels * unet.sample_size ** 2 * 4


def driver_run(steps: int, extra: list[str], run_dir: Path) -> dict[str, Any]:
    """A Ray run of the default config: the per-step `handoff/*` figures against the step's sample bytes."""
    overrides = [f"run.steps={steps}", f"run.eval_every={steps}", f"run.checkpoint_every={steps}",
                 "run.progress=false", "serve.port=0", *extra]
    t0 = time.perf_counter()
    DRIVER_FETCHES.evaluations.clear()
    result = train(DEFAULT, [*overrides, f"run.run_dir={run_dir}"])
    evaluations = list(DRIVER_FETCHES.evaluations)  # counted apart from the steps: step 0 and the last step
    rows = read_metrics(result.run_dir)
    samples = digits_samples_bytes(overrides)
    keys = ("driver_bytes", "driver_tensor_bytes", "driver_inlined_bytes", "batch_bytes")
    per_step = {k: [r[f"handoff/{k}"] for r in rows] for k in keys}
    return {
        "config": "configs/digits-grpo.yaml", "overrides": overrides, "steps": len(rows),
        "wall_s": time.perf_counter() - t0,
        "samples_bytes_per_step": samples,
        **{k: spread(v) for k, v in per_step.items()},
        "driver_over_samples": spread([d / samples for d in per_step["driver_bytes"]]),
        "driver_tensor_over_samples": spread([d / samples for d in per_step["driver_tensor_bytes"]]),
        "driver_over_batch": spread([d / b for d, b in zip(per_step["driver_bytes"], per_step["batch_bytes"])]),
        "evaluation_fetches": evaluations, "eval_samples": result.final_eval.get("n_samples"),
        "sync": sync_figures(rows, "digits UNet, full weights (Ray)"),
    }


# ------------------------------------------------------------------------------------- b. the object store
@ray.remote(num_cpus=0)
class Producer:
    """Actor A: makes a tensor and returns it (Ray stores the return in the object store), or clones one."""

    @ray.method(num_returns=2)
    def produce(self, nbytes: int) -> tuple[torch.Tensor, float]:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        return t, time.time()  # the handoff starts as the method returns

    def clone_s(self, nbytes: int) -> float:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        t0 = time.perf_counter()
        c = t.clone()
        s = time.perf_counter() - t0
        assert c.numel() == t.numel()
        return s


@ray.remote(num_cpus=0)
class Consumer:
    """Actor B: fetches the boxed ref (as a learner rank fetches a batch) and says when it had it."""

    def fetch(self, box: list[ray.ObjectRef]) -> tuple[float, int]:
        t = ray.get(box[0])
        done = time.time()
        return done, int(t.numel() * t.element_size())


def object_store(sizes: dict[str, int], repeats: int) -> list[dict[str, Any]]:
    """Per size: A -> object store -> B seconds vs clone seconds in A's process, `repeats` times each, alternating."""
    a, b = Producer.remote(), Consumer.remote()
    ray.get(a.clone_s.remote(1024))  # both processes up before timing
    ray.get(b.fetch.remote([ray.put(torch.zeros(1))]))
    out = []
    for name, nbytes in sizes.items():
        handoff, clone = [], []
        for _ in range(repeats):
            tensor_ref, start_ref = a.produce.remote(nbytes)
            done, got = ray.get(b.fetch.remote([tensor_ref]))
            assert got == nbytes // 4 * 4, (got, nbytes)
            handoff.append(done - ray.get(start_ref))
            del tensor_ref
            clone.append(ray.get(a.clone_s.remote(nbytes)))
        mb = nbytes // 4 * 4 / MB
        out.append({"tensor": name, "bytes": nbytes // 4 * 4, "object_store_s": spread(handoff),
                    "clone_s": spread(clone),
                    "object_store_MB_per_s": spread([mb / s for s in handoff]),
                    "clone_MB_per_s": spread([mb / s for s in clone]),
                    "object_store_over_clone_time": spread([h / c for h, c in zip(handoff, clone)])})
        print(json.dumps(out[-1]), flush=True)
    ray.kill(a)
    ray.kill(b)
    return out


# ------------------------------------------------------------------------------------------------ c. sync
def sync_figures(rows: list[dict], label: str) -> dict[str, Any]:
    """`sync/bytes` and `timing_s/sync` of a run's steps (the first dropped when there are more: warm-up)."""
    kept = rows[1:] if len(rows) > 1 else rows
    return {"what": label, "sync_bytes": rows[0]["sync/bytes"], "steps": len(kept),
            "sync_s": spread([r["timing_s/sync"] for r in kept]),
            "sync_MB_per_s": spread([r["sync/bytes"] / MB / r["timing_s/sync"] for r in kept])}


def tiny_sd3_sync(steps: int, root: Path) -> list[dict[str, Any]]:
    """The tiny SD3-style pipeline (tests/tiny_models.py) through Ray: LoRA adapters vs full weights."""
    from tests.tiny_models import save_tiny_clip, save_tiny_sd3_pipeline

    sd3, clip = save_tiny_sd3_pipeline(root / "sd3"), save_tiny_clip(root / "clip")
    base = ["testbed.name=text_to_image", f"testbed.pretrained={sd3}", "testbed.prompts.train=tiny",
            "testbed.prompts.prompts_per_step=2", f"testbed.reward.models=[{{kind: clip_score, model: {clip}}}]",
            "sampler.kind=flow_sde", "sampler.shift=3.0", "sampler.num_steps=4", "sampler.group_size=4",
            "objective.train_min_std=0.0", "learner.micro_batch_size=8", "learner.lr=1e-3",
            f"run.steps={steps}", f"run.eval_every={steps}", f"run.checkpoint_every={steps}",
            "run.progress=false", "serve.port=0"]
    out = []
    for name, label, extra in (("lora", "tiny SD3 transformer, LoRA (Ray)", []),
                               ("full", "tiny SD3 transformer, full weights (Ray)", ["testbed.lora=null"])):
        result = train(None, [*base, *extra, f"run.run_dir={root / name}"])
        out.append({**sync_figures(read_metrics(result.run_dir), label), "overrides": [*base, *extra]})
        print(json.dumps(out[-1]["sync_bytes"]), label, flush=True)
    lora, full = out
    ratio = {"full_over_lora_bytes": full["sync_bytes"] / lora["sync_bytes"],
             "full_over_lora_time": full["sync_s"]["median"] / lora["sync_s"]["median"]}
    return [*out, ratio]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="steps of each Ray run (a, c)")
    ap.add_argument("--repeats", type=int, default=7, help="repeats of each object-store transfer (b)")
    ap.add_argument("--quick", action="store_true", help="smoke scale: 2 steps of group 4, 3 repeats, no 256 MB")
    ap.add_argument("--out", type=Path, default=RESULTS / "handoff.json")
    args = ap.parse_args()
    steps, repeats = (2, 3) if args.quick else (args.steps, args.repeats)
    digits_extra = ["sampler.group_size=4", "testbed.eval_samples_per_class=2"] if args.quick else []
    init_ray(num_cpus=2)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"quick": args.quick, "ray": ray.__version__, "torch": torch.__version__,
                              "host": "one node (object store in shared memory; across nodes add the network)"}
    with tempfile.TemporaryDirectory() as tmp:
        result["driver"] = driver_run(steps, digits_extra, Path(tmp) / "digits")
        print(json.dumps(result["driver"], indent=1), flush=True)
        sizes = {"step's samples (run a)": result["driver"]["samples_bytes_per_step"],
                 "step's batch (run a)": int(result["driver"]["batch_bytes"]["median"]), "16 MB": 16 * MB}
        if not args.quick:
            sizes["256 MB"] = 256 * MB
        result["object_store"] = object_store(sizes, repeats)
        result["sync"] = {"tiny_sd3": tiny_sd3_sync(steps + 1, Path(tmp) / "t2i"),
                          "digits_full": result["driver"]["sync"]}
    cited = RESULTS / "lora_sync_bytes.json"
    if cited.exists():
        result["sync"]["real_architectures_cited"] = {
            "source": "benchmarks/lora_sync_bytes.py -> benchmarks/results/lora_sync_bytes.json",
            "full_over_lora_bytes": {r["model"]: r["ratio"] for r in json.loads(cited.read_text())}}
    result["wall_s"] = time.perf_counter() - t0
    ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
