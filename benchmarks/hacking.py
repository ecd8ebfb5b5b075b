"""Reward-hacking benchmark: which update holds gold accuracy and diversity against a hackable proxy?

    python benchmarks/hacking.py [--suite ddim|flow] [--steps 40] [--seeds 0 1 2] [--jobs 2] [--out DIR]

On digits, every method trains against the same deliberately hackable proxy (`--proxy`, default a
linear classifier trained on few images) while the gold classifier (disjoint data, never trained on)
and the diversity of the samples are watched. Each (method, seed) runs `configs/digits-<method>.yaml`
with the benchmark's overrides, in its own process (`--jobs` at a time, one torch thread each),
through the product loop, `steadyrl train --local` (benchmarks/compare.py).

Writes to the output folder: results.json (every run's per-step rows and evals), table.md (final
gold accuracy, proxy reward and diversity per method: mean ± std over seeds, and the change from
the base model; with a gold target, the training seconds to reach it), curves.png (per-method
curves with seed bands) and, with a gold target, gold_vs_time.png.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import preset, run_all, write_results  # noqa: E402

METHODS = ["grpo", "stabledrl.paper", "stabledrl.code", "grpo_guard.paper", "gardo.paper", "gardo.seed", "draft"]
# Named variants run beside the presets: GARDO's uncertainty sign. The authors' code takes u = rank_proxy -
# mean rank_aux (rank 1 = highest), so u > 0 means the proxy ranks a sample worse than the auxiliaries do, the
# opposite of "the proxy over-rates it"; `over_rating` flips the sign.
VARIANTS = {"gardo.paper[over_rating]": ("gardo.paper", ["objective.uncertainty_sign=over_rating"]),
            # gardo.paper's loss before it followed their code (docs/objectives.md): KL summed over the gated terms
            # / all terms, PPO terms without the std_b / mean(std) weight (the earlier gardo.paper rows)
            "gardo.paper[kl_all,no_std_weight]": ("gardo.paper", ["objective.kl_average=all_terms",
                                                                  "objective.std_weighting=none"]),
            # the run-health controls on the method this benchmark sees hacked most (docs/health.md): a KL term
            # alone, the same KL raised 10x for 5 updates after each proxy-up/gold-down event, and collapse
            # rollback (its gold-drop rule)
            "stabledrl.paper[kl]": ("stabledrl.paper", ["objective.kl_coef=0.01"]),
            "stabledrl.paper[kl+anomaly]": ("stabledrl.paper", ["objective.kl_coef=0.01",
                                                                "health.anomaly.enabled=true"]),
            "stabledrl.paper[rollback]": ("stabledrl.paper", ["health.rollback.enabled=true"]),
            # the rectified-flow suite (`--suite flow`): the flow UNet of digits-flow-grpo.yaml, its GRPO beside
            # DiffusionNFT's two forms, GARDO on NFT and the windowed-SDE presets
            "flow.grpo": ("configs/digits-flow-grpo.yaml", []),
            "flow.mixgrpo": ("configs/digits-flow-mixgrpo.yaml", []),
            "flow.grpo_fast": ("configs/digits-flow-grpo-fast.yaml", []),
            "diffusion_nft.code": ("configs/digits-flow-nft.yaml", []),
            "diffusion_nft.paper": ("configs/digits-flow-nft.yaml", ["objective.name=diffusion_nft.paper"]),
            # the on-policy variant: the rollouts sample with the trained policy, not the authors' old (EMA) copy
            "diffusion_nft.code[sample_with=current]": ("configs/digits-flow-nft.yaml",
                                                        ["objective.sample_with=current"]),
            "gardo.nft": ("configs/digits-flow-gardo-nft.yaml", [])}
FLOW_METHODS = ["flow.grpo", "flow.mixgrpo", "flow.grpo_fast", "diffusion_nft.code", "diffusion_nft.paper",
                "gardo.nft"]

# Hackable proxies: a linear classifier fit on ~5% of the proxy split (about 37 images), rewarding
# p(requested digit) or its unbounded log-odds; the CNN and MLP members stay as the ensemble's
# auxiliaries (GARDO's uncertainty) and the CNN's features measure diversity.
def _weak_linear(output: str) -> list[str]:
    return ["testbed.reward.members=[{name: cnn, arch: cnn, seed: 1, epochs: 40}, {name: mlp, arch: mlp, seed: 2, epochs: 60}, "
            f"{{name: weak_linear, arch: linear, seed: 5, epochs: 200, subset_fraction: 0.05, output: {output}}}]",
            "testbed.reward.train_on=weak_linear", "testbed.reward.min_proxy_accuracy=0.5"]


PROXIES = {"weak_linear": _weak_linear("probability"), "weak_linear_log_odds": _weak_linear("log_odds")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=["ddim", "flow"], default="ddim",
                    help="the default methods: the DDIM presets, or the rectified-flow suite (flow GRPO, windowed "
                         "SDE, DiffusionNFT, GARDO on NFT) with evaluations every 4 steps and a gold target of 80%%")
    ap.add_argument("--methods", nargs="+", default=None,
                    help=f"presets (configs/digits-<method>.yaml) or named variants {sorted(VARIANTS)}")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--samples-per-class", type=int, default=8, help="group size")
    ap.add_argument("--proxy", choices=sorted(PROXIES), default="weak_linear_log_odds")
    ap.add_argument("--eval-every", type=int, default=None, help="default: 10 (flow suite: 4)")
    ap.add_argument("--gold-target", type=float, default=None, help="report each method's training time to this "
                    "gold accuracy (default: none; flow suite: 0.8)")
    ap.add_argument("--eval-samples-per-class", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one process and torch thread each)")
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/hacking (flow suite: "
                    "hacking_flow)")
    ap.add_argument("--set", nargs="*", default=[], help="extra key.sub=value overrides for every run")
    args = ap.parse_args()
    flow = args.suite == "flow"
    args.methods = args.methods or (FLOW_METHODS if flow else METHODS + list(VARIANTS)[:1])
    args.eval_every = args.eval_every or (4 if flow else 10)
    args.gold_target = args.gold_target if args.gold_target is not None else (0.8 if flow else None)
    args.out = args.out or ROOT / "benchmarks" / "results" / ("hacking_flow" if flow else "hacking")
    variants = [(m, *VARIANTS.get(m, (m, [])) ) for m in args.methods]
    for label, method, _ in variants:
        if not preset(method).exists():
            ap.error(f"no preset {preset(method)} for method {label!r}")
    overrides = [*PROXIES[args.proxy], f"run.steps={args.steps}", f"sampler.group_size={args.samples_per_class}",
                 f"testbed.eval_samples_per_class={args.eval_samples_per_class}", *args.set]
    from benchmarks.compare import warm_caches
    from steadyrl.services.config import load_config

    warm_caches(load_config(preset(variants[0][1]), overrides))  # build cached models once, not per process
    t0 = time.perf_counter()
    runs = run_all([(label, method, overrides + extra) for label, method, extra in variants], args.seeds, args.jobs,
                   args.eval_every)
    setting = (f"proxy {args.proxy}, {args.steps} steps, {args.samples_per_class} samples per class (group), "
               f"seeds {args.seeds}, eval on {args.eval_samples_per_class} seeded samples per class; "
               f"wall {time.perf_counter() - t0:.0f} s with {args.jobs} jobs")
    print(write_results(runs, setting, args.out, {"overrides": overrides}, args.gold_target))


if __name__ == "__main__":
    main()
