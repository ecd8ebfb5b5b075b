"""REST load on the digits reward ensemble, with and without `@serve.batch`, side by side in one run.

    python benchmarks/reward_load.py [--requests 200] [--concurrency 8 32] [--samples 8]
        -> benchmarks/results/reward_load.json, benchmarks/results/reward_load.png

Starts a local Ray and Serve (loopback only), deploys the reward app once per mode (`serve.batching` true /
false, everything else equal), and at each concurrency level fires `--requests` POST /v1/score of `--samples`
real digits each from that many concurrent clients (after `--warmup` requests), reporting throughput
(requests/s, samples/s) and latency percentiles per mode and level. The clients share the machine with Serve,
so on a small machine the figures are a lower bound and mostly compare the two modes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def fire(url: str, bodies: list[dict], concurrency: int) -> tuple[list[float], float, int]:
    """POST every body with at most `concurrency` in flight: (latencies s, wall s, non-200 count)."""
    latencies: list[float] = []
    errors = 0
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                body = queue.get_nowait()
                t0 = time.perf_counter()
                resp = await client.post(url, json=body)
                latencies.append(time.perf_counter() - t0)
                errors += resp.status_code != 200

        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return latencies, time.perf_counter() - start, errors


def measure(batching: bool, port: int, bodies: list[dict], args: argparse.Namespace) -> list[dict]:
    from ray import serve

    from steadyrl.services.config import ServeConfig, load_config
    from steadyrl.services.serving import deploy_reward_app
    from steadyrl.services.testbeds import build_testbed

    name = f"reward_load_{'batched' if batching else 'unbatched'}"
    cfg = ServeConfig(batching=batching, max_ongoing_requests=max(args.concurrency))
    deploy_reward_app(build_testbed(load_config(None)), cfg, name=name, route_prefix=f"/{name}")
    url = f"http://127.0.0.1:{port}/{name}/v1/score"
    rows = []
    try:
        for concurrency in args.concurrency:
            asyncio.run(fire(url, bodies[: args.warmup], concurrency))
            latencies, wall, errors = asyncio.run(fire(url, bodies[args.warmup:], concurrency))
            n = len(latencies)
            rows.append({"batching": batching, "concurrency": concurrency, "requests": n, "errors": errors,
                         "wall_s": wall, "requests_per_s": n / wall, "samples_per_s": n * args.samples / wall,
                         "latency_ms": {"p50": 1e3 * percentile(latencies, 50), "p99": 1e3 * percentile(latencies, 99),
                                        "mean": 1e3 * statistics.mean(latencies), "max": 1e3 * max(latencies)}})
    finally:
        serve.delete(name)
    return rows


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(args.concurrency)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.5, 3.4))
    width = 0.38
    for i, (batching, color) in enumerate(((True, "tab:blue"), (False, "tab:orange"))):
        rows = [r for r in results if r["batching"] == batching]
        xs = [j + (i - 0.5) * width for j in range(len(levels))]
        label = "@serve.batch" if batching else "no batching"
        ax1.bar(xs, [r["samples_per_s"] for r in rows], width, color=color, label=label)
        ax2.bar(xs, [r["latency_ms"]["p99"] for r in rows], width, color=color, alpha=0.45)
        ax2.bar(xs, [r["latency_ms"]["p50"] for r in rows], width, color=color, label=label)
    for ax, title, unit in ((ax1, "throughput", "samples / s"), (ax2, "latency: p50 (solid), p99 (light)", "ms")):
        ax.set_xticks(range(len(levels)), [f"{c} clients" for c in levels])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.suptitle(f"POST /v1/score, {args.samples} digits per request, {os.cpu_count()} CPUs (clients included)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="measured requests per mode and level")
    ap.add_argument("--warmup", type=int, default=40, help="requests before measuring, per mode and level")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="clients in flight at once")
    ap.add_argument("--samples", type=int, default=8, help="digits per request")
    ap.add_argument("--out", type=Path, default=RESULTS / "reward_load.json")
    args = ap.parse_args()

    import torch

    from steadyrl.rollout.digits import digit_splits, load_digits_tensors
    from steadyrl.services.config import ServeConfig
    from steadyrl.services.runtime.ray_session import init_ray, start_serve

    images, labels = load_digits_tensors()
    test = digit_splits().test
    bodies = []
    for i in range(args.warmup + args.requests):
        idx = torch.as_tensor([test[(i * args.samples + j) % len(test)] for j in range(args.samples)])
        bodies.append({"samples": [{"image": img[0].tolist(), "digit": int(y)}
                                   for img, y in zip(images[idx], labels[idx])]})
    init_ray()
    _, port = start_serve(ServeConfig(port=0))  # 127.0.0.1
    results = [row for batching in (True, False) for row in measure(batching, port, bodies, args)]
    out = {"benchmark": "reward_load", "command": " ".join(["python benchmarks/reward_load.py", *sys.argv[1:]]),
           "setup": {"requests": args.requests, "warmup": args.warmup, "concurrency": args.concurrency,
                     "samples_per_request": args.samples, "app": "digits RewardConfig() (3 members + gold)",
                     "cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    plot(results, args, args.out.with_suffix(".png"))
    for r in results:
        print(f"batching={str(r['batching']):5} clients={r['concurrency']:3}  {r['samples_per_s']:7.1f} samples/s  {r['requests_per_s']:6.1f} req/s"
              f"  p50 {r['latency_ms']['p50']:6.1f} ms  p99 {r['latency_ms']['p99']:6.1f} ms  errors {r['errors']}")


if __name__ == "__main__":
    main()
