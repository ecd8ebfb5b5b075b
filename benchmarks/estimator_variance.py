"""Variance of the on-policy log-ratio under each dLLM likelihood estimator, against n MC samples.

On policy (theta = theta_old) the true log-ratio is 0; what an estimator gives instead is

    log rho_hat = ell_hat(masks A) - ell_hat(masks B),   ell_hat = (1/n) sum_j ell_j

with A and B drawn independently (StableDRL's noisy-ratio setting; with shared masks it is exactly 0).
For each estimator and mask scheme (rollout/likelihood.py: one_step (d1); elbo and coupled (mask + complement)
with uniform (l ~ U{1..L}) and stratified (LLaDA's counts spread over the n samples) masks; elbo with
block_random (SPG: blocks of `--block-length`, earlier positions and the prompt masked with p)) and n in
{1, 2, 4, 8, 16}, on completions sampled from the pre-trained arith model, this measures

    Var[log rho_hat]  per sequence (over `--draws` independent mask pairs), averaged over sequences,
    and the forward passes each estimate costs (coupled: 2n, otherwise n),

in `logp_reduce: sum` units (the log-likelihood of the completion), over the positions up to each
completion's first EOS as training scores them (`sampler.score_after_eos: false`). The one-step estimator's only
randomness is its prompt mask (p = 0.15): low variance, but it estimates a different quantity (every
completion token masked at once), not the ELBO.

    python benchmarks/estimator_variance.py   # ~6 min on 2 cores -> benchmarks/results/estimator_variance/
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from rich.progress import track

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = (("one_step", "uniform"), ("elbo", "uniform"), ("elbo", "stratified"), ("elbo", "block_random"),
            ("coupled", "uniform"), ("coupled", "stratified"))  # (estimator, mask scheme)


def label(estimator: str, scheme: str) -> str:
    return estimator if estimator == "one_step" else f"{estimator}/{scheme}"


def measure(n_values: list[int], draws: int, prompts: int, per_prompt: int, seed: int, block_length: int) -> dict:
    from safetensors.torch import load_file

    from steadyrl.rollout.likelihood import draw_masks, estimate
    from steadyrl.services.config import load_config
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(ROOT / "configs" / "arith-grpo.yaml")
    testbed = build_testbed(cfg)
    model = testbed.build_policy(load_file(str(testbed.base_weights(progress=True)))).double()
    sampler = testbed.build_sampler()
    prompt_ids, _ = testbed.train_prompts(0, 1, 0)
    batch = sampler.sample(model, prompt_ids[:prompts], per_prompt, torch.Generator().manual_seed(seed))
    B, L, P = len(batch), batch.samples.shape[1], batch.cond.shape[1]
    scored = sampler.valid(batch.samples)  # L_V per sequence: the positions up to its first EOS
    gen = torch.Generator().manual_seed(seed + 1)
    rows = []
    with torch.no_grad():
        for estimator, scheme in VARIANTS:
            for n in track(n_values, description=f"{label(estimator, scheme):20s}"):
                # 2 * draws independent n-sample estimates per sequence, all in one batched forward per MC sample
                cond, samples = batch.cond.repeat(2 * draws, 1), batch.samples.repeat(2 * draws, 1)
                valid = sampler.valid(samples)  # positions up to the first EOS, as training scores them
                masks = draw_masks(estimator, B * 2 * draws, n, L, P, sampler.cfg.prompt_mask_prob, gen, scheme,
                                   block_length, valid)
                ell = torch.stack([estimate(model, estimator, cond, samples,
                                            (masks.completion[:, j], masks.prompt[:, j]), sampler.mask_token_id,
                                            "sum", valid=valid).logp for j in range(n)], 1).mean(1)
                ell = ell.view(2, draws, B)
                log_rho = ell[0] - ell[1]  # [draws, B]
                rows.append({"estimator": estimator, "scheme": scheme, "n": n,
                             "forwards": n * (2 if estimator == "coupled" else 1),
                             "var_log_rho": float(log_rho.var(0).mean()),
                             "var_log_rho_sem": float(log_rho.var(0).std() / B**0.5),
                             "mean_log_rho": float(log_rho.mean()),
                             "mean_ell": float(ell.mean()), "var_ell": float(ell.reshape(-1, B).var(0).mean())})
    return {"setting": {"model": "arith-grpo.yaml base model (pre-trained, float64)", "sequences": B,
                        "draws_per_sequence": draws, "gen_length": L, "reduce": "sum",
                        "scored_length_mean": L if scored is None else float(scored.sum(1).double().mean()),
                        "prompt_mask_prob": sampler.cfg.prompt_mask_prob, "block_length (block_random)": block_length,
                        "seed": seed},
            "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for estimator, scheme in VARIANTS:
        rs = [r for r in result["rows"] if (r["estimator"], r["scheme"]) == (estimator, scheme)]
        axes[0].plot([r["n"] for r in rs], [r["var_log_rho"] for r in rs], "o-", label=label(estimator, scheme))
        axes[1].plot([r["forwards"] for r in rs], [r["var_log_rho"] for r in rs], "o-", label=label(estimator, scheme))
    for ax, xlabel in zip(axes, ("MC samples n", "forward passes per estimate")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("Var[log rho] on policy (independent masks)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("dLLM likelihood estimators: on-policy log-ratio variance (arith base model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict) -> str:
    lines = ["| estimator / mask scheme | n | forwards | Var[log rho] | mean log rho | mean ell |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {label(r['estimator'], r['scheme'])} | {r['n']} | {r['forwards']} | {r['var_log_rho']:.4f} ± "
                     f"{r['var_log_rho_sem']:.4f} | {r['mean_log_rho']:+.4f} | {r['mean_ell']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--draws", type=int, default=64, help="independent mask pairs per sequence")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--per-prompt", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-length", type=int, default=2, help="block_random's blocks (arith completions: 4)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "estimator_variance")
    args = parser.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    result = measure(args.n, args.draws, args.prompts, args.per_prompt, args.seed, args.block_length)
    result["wall_s"] = time.perf_counter() - t0
    result["command"] = "python benchmarks/estimator_variance.py " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    md = table(result)
    (args.out / "table.md").write_text(md)
    plot(result, args.out / "variance.png")
    print(md)
    print(f"wrote {args.out} in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
