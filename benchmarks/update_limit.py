"""The learner's update against the plain limit: a plain PyTorch AdamW loop computing the same loss on the same batch.

    python benchmarks/update_limit.py [--repeats 9] [--config configs/digits-grpo.yaml]
        -> benchmarks/results/update_limit.json

Each repeat samples one batch with the product's rollout code (`services.runtime.rollouts.Rollouts`, scored by the
in-process reward ensemble) at the learner's current weights, then times on that batch, in rotating order:

- ours, recompute:  `learner_rank.update_on` (the DeepSpeed engine, objective, term producer, health panel) with the
                    no-grad pre-pass recomputing the old log-probs at every trained step (`learner.old_logp:
                    recompute`, the behaviour before `auto` existed);
- ours, trusted:    the same update between two checks of `learner.old_logp: auto` (the default): the rollout's
                    log-probs stand in for the recompute; the pre-pass computes only the KL monitor;
- plain:            `torch.optim.AdamW` over the same trained parameters, the GRPO clip loss written out in a few
                    lines: the rollout's log-probs as the old ones, the same micro-batches, drawn steps, gradient
                    clipping, optimiser steps and epochs; no DeepSpeed, no pre-pass, no metrics.

Before the timed repeats, one update of each from the same weights and optimiser state checks that the two
compute the same thing: the plain loop draws the learner's random numbers in the learner's order, so the weights
after one update must agree to float32 rounding (`check.max_abs_weight_diff`). Threads: `--threads`, by default
every core (the learner actor's default, `ray.torch_threads` unset). Median ratios over the repeats, with
min..max. Target: ours / plain <= 1.2. `auto` amortised: (9 trusted + 1 checked update) / 10, the default
`learner.logp_check_every` being 10.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from steadyrl.rollout.batch import POLICY_VERSION  # noqa: E402
from steadyrl.rollout.numerics import using_threads  # noqa: E402
from steadyrl.rollout.policy import load_trainable_state, trainable_state  # noqa: E402
from steadyrl.services.config import load_config  # noqa: E402
from steadyrl.services.runtime.learner_rank import build_rank, update_on  # noqa: E402
from steadyrl.services.runtime.local_runtime import LocalScorer  # noqa: E402
from steadyrl.services.runtime.rank_env import free_port, torch_threads  # noqa: E402
from steadyrl.services.runtime.rollouts import Rollouts  # noqa: E402
from steadyrl.services.testbeds import build_testbed  # noqa: E402
from steadyrl.trainer.distributed import micro_batch_count, split_into  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "update_limit.json"


class PlainLoop:
    """GRPO's update as a hand-written PyTorch loop: the limit the learner's update is measured against."""

    def __init__(self, cfg, testbed, base_weights: dict[str, torch.Tensor], sampler):
        self.cfg, self.sampler = cfg, sampler
        self.policy = testbed.build_policy(base_weights).train()
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        lc = cfg.learner
        self.optim = torch.optim.AdamW(self.params, lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)

    def update(self, batch, generator: torch.Generator, train_steps: torch.Tensor) -> None:
        """A_i = (r_i - mean_g r) / (std_g r + eps); per drawn step, loss = sum max(-A rho, -A clip(rho)) / n_terms."""
        lc, obj = self.cfg.learner, self.cfg.objective
        r, adv = batch.train_reward(), torch.zeros(len(batch))
        for g in batch.group.unique():
            idx = batch.group == g
            adv[idx] = (r[idx] - r[idx].mean()) / (r[idx].std(unbiased=False) + obj.eps_std)
        batch = batch.replace(advantages=adv)
        perm = torch.randperm(len(batch), generator=generator)
        micro = split_into(batch.index(perm), micro_batch_count([len(batch)], lc.micro_batch_size), lc.micro_batch_size)
        for mb in micro:  # the learner's KL monitor draws one step per sample here: the same draws, unused
            torch.randint(len(train_steps), (len(mb),), generator=generator)
        n = max(1, round(obj.timestep_fraction * len(train_steps)))
        for _ in range(lc.inner_epochs):
            for mb in micro:
                chosen = torch.stack([train_steps[torch.randperm(len(train_steps), generator=generator)][:n]
                                      for _ in range(len(mb))])
                for j in range(n):
                    step = chosen[:, j]
                    new = self.sampler.log_prob(self.policy, mb, step).logp
                    ratio = (new - mb.old_logp[torch.arange(len(mb)), step]).exp()
                    a = mb.advantages
                    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - obj.eps_clip, 1 + obj.eps_clip)).sum()
                    (loss / (len(mb) * n)).backward()
                torch.nn.utils.clip_grad_norm_(self.params, lc.grad_clip)
                self.optim.step()
                self.optim.zero_grad(set_to_none=True)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "digits-grpo.yaml"))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the runtime's, every core)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    cfg = load_config(args.config)
    if cfg.objective.name != "grpo":
        raise SystemExit(f"the plain loop writes out GRPO's loss; {args.config} trains {cfg.objective.name}")
    threads = args.threads or torch_threads(cfg)
    testbed = build_testbed(cfg)
    base = load_file(str(testbed.base_weights(progress=True)))
    testbed.prepare_rewards(None)
    with using_threads(threads):
        learner = build_rank(cfg, base, 0, 1, "127.0.0.1", free_port())
        rollouts, scorer = Rollouts(cfg, base), LocalScorer(testbed.reward_ensemble())
        plain = PlainLoop(cfg, testbed, base, rollouts.sampler)

        def fresh_batch(step: int):
            """A batch sampled at the learner's weights, without its policy version: each variant of a repeat
            starts from those weights again (`restart`), so the batch is current for every one of them."""
            rollouts.load(learner.updates, learner.weights())
            batch = rollouts.generate(step, 0, 1, scorer)[0]
            return batch.replace(extras={k: v for k, v in batch.extras.items() if k != POLICY_VERSION})

        # the check: one update of each from the same weights, fresh optimisers, the same random draws
        batch, start = fresh_batch(0), learner.weights()
        generator_state = learner.generator.get_state()
        first = update_on(learner, [batch])
        load_trainable_state(plain.policy, start)
        plain.update(batch, torch.Generator().set_state(generator_state), learner.batch_train_steps())
        ours_w, plain_w = learner.weights(), trainable_state(plain.policy)
        diff = max(float((ours_w[k] - plain_w[k].detach()).abs().max()) for k in ours_w)
        moved = max(float((ours_w[k] - start[k]).abs().max()) for k in ours_w)
        check = {"max_abs_weight_diff": diff, "max_abs_weight_change": moved,
                 "first_update_recomputed": first["policy/old_logp_recomputed"]}
        print(f"check: weights after one update differ by {diff:.2e} (the update moved them by {moved:.2e})")

        trust = learner.logp_trust
        trust.check_every = 10**9  # "trusted" measures the update between two checks

        def ours(mode: str):
            def run(b):
                trust.mode, trust.trusted = mode, True
                return update_on(learner, [b])
            return run

        variants = {"recompute": ours("recompute"), "trusted": ours("auto"),
                    "plain": lambda b: plain.update(b, torch.Generator().manual_seed(1), learner.batch_train_steps())}
        times: dict[str, list[float]] = {k: [] for k in variants}
        prepass: dict[str, list[float]] = {"recompute": [], "trusted": []}
        names = list(variants)
        for r in range(args.repeats):
            batch = fresh_batch(r + 1)
            order = names[r % 3:] + names[:r % 3]  # each variant first, second and third in turn
            weights = learner.weights()
            for name in order:
                load_trainable_state(learner.policy, weights)  # restart: every variant updates the same weights
                load_trainable_state(plain.policy, weights)
                out: list = []
                times[name].append(timed(lambda: out.append(variants[name](batch))))
                if name != "plain":
                    metrics = out[0]
                    prepass[name].append(metrics["timing_s/old_policy"])
                    assert metrics["policy/old_logp_recomputed"] == (1.0 if name == "recompute" else 0.0), name
            print(f"repeat {r}: " + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)

    def ratio(a: str, b: str) -> dict[str, float]:
        rs = [x / y for x, y in zip(times[a], times[b])]
        return {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}

    med = {k: statistics.median(v) for k, v in times.items()}
    amortised = (9 * med["trusted"] + med["recompute"]) / 10
    result = {
        "config": str(Path(args.config).resolve().relative_to(ROOT)), "repeats": args.repeats,
        "torch_threads": threads, "batch": len(batch),
        "torch": torch.__version__, "check": check,
        "seconds": times, "median_s": med, "prepass_median_s": {k: statistics.median(v) for k, v in prepass.items()},
        "ratio_recompute_over_plain": ratio("recompute", "plain"),
        "ratio_trusted_over_plain": ratio("trusted", "plain"),
        "ratio_trusted_over_recompute": ratio("trusted", "recompute"),
        "auto_amortised_s": amortised, "auto_amortised_over_plain": amortised / med["plain"],
        "target": 1.2,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=2))


if __name__ == "__main__":
    main()
