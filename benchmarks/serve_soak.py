"""A bounded soak of the digits reward app's REST API: steady valid load while slow clients stall their uploads
and a reward replica is killed, reporting what the valid clients, the slow ones and /healthz saw in each phase.

    python benchmarks/serve_soak.py [--duration 180] [--clients 8] [--slow-clients 40] [--samples 8]
        -> benchmarks/results/serve_soak.json, benchmarks/results/serve_soak.png

Starts a local Ray and Serve (loopback only) and deploys the reward app with `ServeConfig()`'s limits (the
request guard of services/serving/guard.py: `serve.body_timeout_s`, `serve.body_idle_timeout_s`,
`serve.max_unfinished_bodies`). For `--duration` seconds, `--clients` clients each loop POST /v1/score of
`--samples` real digits (after a failure they try again 0.05 s later, not waiting for a 503's Retry-After), and
/healthz is probed once a second. On a schedule (fractions of the duration):

  --slow-window A B   `--slow-clients` raw sockets send the headers of a POST /v1/score with a large
                      Content-Length and the first bytes of the body, then stall; each reconnects
                      `--reconnect-delay` s after the server answers or closes it (an attacker that keeps
                      coming back), from A to B (default: the middle third);
  --kill-at F         one replica of a member deployment (`--kill-deployment`, default the first member) is
                      killed with `ray.kill` (default 1/6, so that Serve has replaced it before the
                      slow clients come: that took about 20 s on 2 CPUs).

Per phase (baseline / after kill / slow clients / after slow clients, each named after the event that starts
it; a request belongs to the phase it started in): valid requests done, their p50/p99 latency, errors by status
code and transport error, the slow connections' outcomes (408 / 503 / closed ...), and /healthz latency. The
recovery after the kill: the errors, the time until Serve runs a new replica, and the time until the first
`--recovery-run` consecutive successful requests started after the kill. The clients share the machine with
Serve, so on a small machine the figures are what this machine can do, not what Serve can. Nothing here asserts
a timing: the numbers go to the JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.reward_load import percentile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
APP = "serve_soak"
SLOW_LENGTH = 1_000_000  # announced Content-Length of a slow upload: under serve.max_body_bytes, so no 413
SLOW_PREFIX = b'{"samples": ['  # what a slow client sends of it before it stalls
RETRY_DELAY_S = 0.05  # a valid client's pause after a failed request (it does not wait for Retry-After)


def latency_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": 1e3 * percentile(values, 50), "p99": 1e3 * percentile(values, 99),
            "mean": 1e3 * statistics.mean(values), "max": 1e3 * max(values)}


@dataclass
class Soak:
    """What every task records, times in seconds from the start of the soak."""

    t0: float = 0.0
    valid: list[tuple[float, float, int | str]] = field(default_factory=list)  # (start, latency, status or error)
    health: list[tuple[float, float, int | str]] = field(default_factory=list)
    slow: list[tuple[float, float, str]] = field(default_factory=list)  # (connected, held s, outcome)
    slow_open: list[tuple[float, int]] = field(default_factory=list)  # (t, slow connections open)
    details: dict[int, str] = field(default_factory=dict)  # index in `valid` -> `detail` of an error reply
    open_now: int = 0
    kill: dict = field(default_factory=dict)

    def now(self) -> float:
        return time.perf_counter() - self.t0


def outcome(exc: BaseException) -> str:
    """A transport error's name (ReadTimeout, ConnectError, RemoteProtocolError ...)."""
    return type(exc).__name__


async def valid_client(client: httpx.AsyncClient, url: str, bodies: list[bytes], first: int, soak: Soak,
                       end: float) -> None:
    """Loop POST /v1/score of real digits until `end`, recording each request."""
    i = first
    while soak.now() < end:
        body = bodies[i % len(bodies)]
        i += 1
        start = soak.now()
        t0 = time.perf_counter()
        try:
            resp = await client.post(url, content=body, headers={"content-type": "application/json"})
            status: int | str = resp.status_code
            if status != 200:
                soak.details[len(soak.valid)] = resp.text[:160]
        except httpx.HTTPError as exc:
            status = outcome(exc)
        soak.valid.append((start, time.perf_counter() - t0, status))
        if status != 200:
            await asyncio.sleep(RETRY_DELAY_S)


async def health_probe(client: httpx.AsyncClient, url: str, soak: Soak, end: float) -> None:
    """GET /healthz once a second (each probe on its own: a slow one does not delay the next)."""

    async def probe() -> None:
        start = soak.now()
        t0 = time.perf_counter()
        try:
            status: int | str = (await client.get(url)).status_code
        except httpx.HTTPError as exc:
            status = outcome(exc)
        soak.health.append((start, time.perf_counter() - t0, status))

    probes = []
    tick = math.ceil(soak.now())
    while tick < end:
        await asyncio.sleep(max(0.0, tick - soak.now()))
        probes.append(asyncio.ensure_future(probe()))
        soak.slow_open.append((soak.now(), soak.open_now))
        tick += 1
    await asyncio.gather(*probes)


async def slow_client(port: int, path: str, soak: Soak, start: float, end: float, delay: float) -> None:
    """From `start` to `end`: connect, send headers with a large Content-Length and a partial body, stall until
    the server answers or closes; record the outcome; come back `delay` s later."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {SLOW_LENGTH}\r\n\r\n").encode() + SLOW_PREFIX
    await asyncio.sleep(max(0.0, start - soak.now()))
    while soak.now() < end:
        connected = soak.now()
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout=10)
            soak.open_now += 1
            writer.write(head)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), timeout=max(0.01, end - soak.now()))
            parts = line.split()
            result = parts[1].decode() if len(parts) > 1 and line.startswith(b"HTTP/") else (
                "closed" if not line else "garbled")
        except asyncio.TimeoutError:
            result = "open at end" if writer is not None else "connect timeout"
        except OSError as exc:  # reset, refused, broken pipe
            result = outcome(exc)
        finally:
            if writer is not None:
                soak.open_now -= 1
                writer.close()
        soak.slow.append((connected, soak.now() - connected, result))
        await asyncio.sleep(delay)


def replica_names(deployment: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{APP}#{deployment}#"))


def kill_replica(deployment: str, soak: Soak, at: float, stop: threading.Event) -> None:
    """(In a thread.) At `at`, ray.kill one replica of `deployment`; then wait until Serve runs a new one."""
    import ray
    from ray import serve

    while soak.now() < at:
        if stop.wait(min(0.05, max(0.0, at - soak.now()))):
            return
    try:
        name = replica_names(deployment)[0]
        victim = ray.get_actor(name, namespace="serve")
        killed = soak.now()
        ray.kill(victim)
        soak.kill.update({"deployment": deployment, "replica": name, "at_s": killed})
        while not stop.is_set():
            fresh = [n for n in replica_names(deployment) if n != name]
            status = serve.status().applications[APP].deployments[deployment].status
            if fresh and str(getattr(status, "value", status)) == "HEALTHY":
                soak.kill.update({"new_replica": fresh[0], "replaced_after_s": soak.now() - killed})
                return
            time.sleep(0.25)
    except Exception as exc:  # noqa: BLE001 - recorded, so the soak's numbers are still written
        soak.kill["error"] = f"{type(exc).__name__}: {exc}"


async def run_soak(port: int, bodies: list[bytes], args: argparse.Namespace, kill_deployment: str) -> Soak:
    base = f"http://127.0.0.1:{port}/{APP}"
    soak = Soak()
    duration = args.duration
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client, \
            httpx.AsyncClient(timeout=args.request_timeout) as prober:
        for i in range(2 * args.clients):  # warm-up, not recorded
            await client.post(f"{base}/v1/score", content=bodies[i % len(bodies)],
                              headers={"content-type": "application/json"})
        await prober.get(f"{base}/healthz")
        soak.t0 = time.perf_counter()
        stop = threading.Event()
        killer = None
        if args.kill_at is not None:
            killer = asyncio.ensure_future(asyncio.to_thread(kill_replica, kill_deployment, soak,
                                                             args.kill_at * duration, stop))
        slow_start, slow_end = (f * duration for f in args.slow_window)
        tasks = [valid_client(client, f"{base}/v1/score", bodies, 1000 * i, soak, duration)
                 for i in range(args.clients)]
        tasks.append(health_probe(prober, f"{base}/healthz", soak, duration))
        tasks += [slow_client(port, f"/{APP}/v1/score", soak, slow_start, slow_end, args.reconnect_delay)
                  for _ in range(args.slow_clients)]
        await asyncio.gather(*tasks)
        if killer is not None:
            stop.set()
            await killer
    return soak


def phases(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    """(name, start, end) of each phase, cut at the scheduled events and named after the latest one: baseline,
    slow clients, after slow clients, after kill (", slow clients on" when the kill falls in the window)."""
    slow_start, slow_end = (f * args.duration for f in args.slow_window)
    kill = None if args.kill_at is None else args.kill_at * args.duration
    events = [(0.0, 0, "baseline")]
    if args.slow_clients > 0:
        events += [(slow_start, 0, "slow clients"), (slow_end, 0, "after slow clients")]
    if kill is not None:  # at the same time as a window's end, the kill names the phase
        events.append((kill, 1, "after kill, slow clients on" if slow_start <= kill < slow_end and args.slow_clients
                       else "after kill"))
    events = sorted(e for e in events if 0 <= e[0] < args.duration)
    ends = [t for t, _, _ in events[1:]] + [args.duration]
    return [(name, t, end) for (t, _, name), end in zip(events, ends) if end > t]


def summarize(soak: Soak, spans: list[tuple[str, float, float]]) -> list[dict]:
    rows = []
    for name, a, b in spans:
        valid = [v for v in soak.valid if a <= v[0] < b]
        ok = [lat for _, lat, status in valid if status == 200]
        health = [h for h in soak.health if a <= h[0] < b]
        slow = [s for s in soak.slow if a <= s[0] < b]
        rows.append({
            "phase": name, "from_s": a, "to_s": b, "requests": len(valid), "ok": len(ok),
            "requests_per_s": len(ok) / (b - a) if b > a else None,
            "latency_ms": latency_ms(ok),
            "errors": dict(Counter(str(status) for _, _, status in valid if status != 200)),
            "healthz": {"probes": len(health), "ok": sum(h[2] == 200 for h in health),
                        "errors": dict(Counter(str(h[2]) for h in health if h[2] != 200)),
                        "latency_ms": latency_ms([h[1] for h in health])},
            "slow_connections": {"connections": len(slow), "outcomes": dict(Counter(s[2] for s in slow)),
                                 "held_s": {k: {"p50": percentile(v, 50), "max": max(v)} for k, v in
                                            _by_outcome(slow).items()}},
        })
    return rows


def _by_outcome(slow: list[tuple[float, float, str]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for _, held, result in slow:
        out.setdefault(result, []).append(held)
    return out


def recovery(soak: Soak, run: int) -> dict | None:
    """After the kill: errors, and the first `run` consecutive successes (by completion) of requests started
    after it; `recovered_after_s` is the completion of the last of them, from the kill."""
    if "at_s" not in soak.kill:
        return None
    at = soak.kill["at_s"]
    done = sorted((start + lat, start, status) for start, lat, status in soak.valid if start + lat >= at)
    streak, recovered = 0, None
    for end, start, status in done:
        if start < at:
            continue
        streak = streak + 1 if status == 200 else 0
        if streak == run:
            recovered = end
            break
    until = recovered if recovered is not None else math.inf
    failed = [(end, status) for end, _, status in done if status != 200 and end <= until]
    started_after = [(start, lat) for start, lat, status in soak.valid if start >= at and status == 200]
    window = [lat for start, lat in started_after if start < (recovered if recovered is not None else at + 10)]
    health = [(s, lat, st) for s, lat, st in soak.health if s >= at]
    health_fast = next((s - at for s, lat, st in health if st == 200 and lat < 1.0), None)
    in_flight = [status for start, lat, status in soak.valid if start < at <= start + lat]
    return {**soak.kill, "recovery_run": run,
            "in_flight_at_kill": dict(Counter(str(status) for status in in_flight)),
            "recovered_after_s": None if recovered is None else recovered - at,
            "errors_until_recovered": dict(Counter(str(status) for _, status in failed)),
            "first_error_after_s": failed[0][0] - at if failed else None,
            "max_latency_ms_until_recovered": 1e3 * max(window) if window else None,
            "healthz_max_ms_after_kill": 1e3 * max(lat for _, lat, _ in health) if health else None,
            "first_healthz_under_1s_after_s": health_fast}


def timeline(soak: Soak, duration: float) -> list[dict]:
    """Per second of the run: valid requests started (ok, errors, p50 latency of the ok ones), the /healthz
    probe, the slow connections open and what the slow connections that ended got."""
    rows = []
    for s in range(math.ceil(duration)):
        valid = [v for v in soak.valid if s <= v[0] < s + 1]
        ok = [lat for _, lat, st in valid if st == 200]
        health = [h for h in soak.health if s <= h[0] < s + 1]
        ended = [res for c, held, res in soak.slow if s <= c + held < s + 1]
        opened = [n for t, n in soak.slow_open if s <= t < s + 1]
        rows.append({"t": s, "ok": len(ok), "errors": len(valid) - len(ok),
                     "p50_ms": 1e3 * percentile(ok, 50) if ok else None,
                     "healthz_ms": 1e3 * health[0][1] if health else None,
                     "healthz_status": str(health[0][2]) if health else None,
                     "slow_open": opened[0] if opened else None, "slow_ended": dict(Counter(ended))})
    return rows


def plot(soak: Soak, spans: list[tuple[str, float, float]], rec: dict | None, tl: list[dict],
         args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ok = [(s, 1e3 * lat) for s, lat, st in soak.valid if st == 200]
    bad = [(s, 1e3 * lat) for s, lat, st in soak.valid if st != 200]
    if ok:
        ax1.scatter(*zip(*ok), s=4, alpha=0.35, color="tab:blue", label="valid POST /v1/score (200)")
    if bad:
        ax1.scatter(*zip(*bad), s=14, marker="x", color="tab:red", label="valid request failed")
    health = sorted((s, 1e3 * lat) for s, lat, _ in soak.health)
    if health:
        ax1.plot(*zip(*health), color="tab:orange", lw=1, marker=".", ms=3, label="GET /healthz")
    ax1.set_yscale("log")
    ax1.set_ylabel("latency (ms, by start)")
    slow_start, slow_end = (min(f * args.duration, args.duration) for f in args.slow_window)
    for ax in (ax1, ax2):
        if args.slow_clients > 0 and slow_end > slow_start:
            ax.axvspan(slow_start, slow_end, color="grey", alpha=0.12, lw=0)
        if rec is not None:
            ax.axvline(rec["at_s"], color="tab:red", ls="--", lw=1)
            if rec.get("recovered_after_s") is not None:
                ax.axvline(rec["at_s"] + rec["recovered_after_s"], color="tab:green", ls=":", lw=1)
    for name, a, b in spans:
        ax1.text((a + b) / 2, 1.01, name, transform=ax1.get_xaxis_transform(), ha="center", fontsize=8)
    ax1.legend(fontsize=7, loc="upper right")
    ts = [r["t"] + 0.5 for r in tl]
    ax2.plot(ts, [r["ok"] for r in tl], color="tab:blue", lw=1, label="valid 200s started / s")
    ax2.plot(ts, [r["errors"] for r in tl], color="tab:red", lw=1, label="valid errors / s")
    ax2.plot(ts, [r["slow_open"] or 0 for r in tl], color="tab:purple", lw=1, label="slow connections open")
    ax2.set_xlabel("s (grey: slow clients; red dashed: replica killed; green dotted: recovered)")
    ax2.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"serve soak: {args.clients} valid clients ({args.samples} digits each), {args.slow_clients} slow "
                 f"clients, {os.cpu_count()} CPUs (clients included)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=180, help="seconds of soak")
    ap.add_argument("--clients", type=int, default=8, help="valid clients, each looping POST /v1/score")
    ap.add_argument("--samples", type=int, default=8, help="digits per valid request")
    ap.add_argument("--slow-clients", type=int, default=40, help="stalling uploads at once in the slow window")
    ap.add_argument("--slow-window", type=float, nargs=2, default=[1 / 3, 2 / 3], metavar=("A", "B"),
                    help="when the slow clients run, as fractions of the duration")
    ap.add_argument("--reconnect-delay", type=float, default=0.5, help="s a slow client waits before coming back")
    ap.add_argument("--kill-at", type=float, default=1 / 6, help="when a replica is killed, as a fraction of "
                    "the duration (negative: no kill)")
    ap.add_argument("--kill-deployment", default=None, help="member deployment whose replica is killed "
                    "(default: reward_<first member>)")
    ap.add_argument("--recovery-run", type=int, default=5, help="consecutive successes that count as recovered")
    ap.add_argument("--request-timeout", type=float, default=60, help="s before a valid request or probe gives up")
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_soak.json")
    args = ap.parse_args()
    if args.kill_at is not None and args.kill_at < 0:
        args.kill_at = None

    import ray
    import torch
    from ray import serve

    from steadyrl.rollout.digits import digit_splits, load_digits_tensors
    from steadyrl.services.config import ServeConfig, load_config
    from steadyrl.services.runtime.ray_session import init_ray, start_serve
    from steadyrl.services.serving import deploy_reward_app
    from steadyrl.services.testbeds import build_testbed

    images, labels = load_digits_tensors()
    test = digit_splits().test
    bodies = []
    for i in range(200):
        idx = torch.as_tensor([test[(i * args.samples + j) % len(test)] for j in range(args.samples)])
        bodies.append(json.dumps({"samples": [{"image": img[0].tolist(), "digit": int(y)}
                                              for img, y in zip(images[idx], labels[idx])]}).encode())
    init_ray()
    _, port = start_serve(ServeConfig(port=0))  # 127.0.0.1
    cfg = ServeConfig()
    testbed = build_testbed(load_config(None))
    members = [m.name for m in testbed.reward_spec().members]
    kill_deployment = args.kill_deployment or f"reward_{members[0]}"
    deploy_reward_app(testbed, cfg, name=APP, route_prefix=f"/{APP}")
    try:
        soak = asyncio.run(run_soak(port, bodies, args, kill_deployment))
    finally:
        serve.delete(APP)
    spans = phases(args)
    rows = summarize(soak, spans)
    rec = recovery(soak, args.recovery_run)
    tl = timeline(soak, args.duration)
    out = {"benchmark": "serve_soak", "command": " ".join(["python benchmarks/serve_soak.py", *sys.argv[1:]]),
           "setup": {"duration_s": args.duration, "clients": args.clients, "samples_per_request": args.samples,
                     "slow_clients": args.slow_clients, "slow_window_s": [f * args.duration for f in args.slow_window],
                     "slow_content_length": SLOW_LENGTH, "reconnect_delay_s": args.reconnect_delay,
                     "kill_at_s": None if args.kill_at is None else args.kill_at * args.duration,
                     "kill_deployment": kill_deployment, "recovery_run": args.recovery_run,
                     "request_timeout_s": args.request_timeout, "valid_retry_delay_s": RETRY_DELAY_S,
                     "serve": {"max_ongoing_requests": cfg.max_ongoing_requests, "upload_slots": cfg.upload_slots(),
                               "body_timeout_s": cfg.body_timeout_s, "body_idle_timeout_s": cfg.body_idle_timeout_s,
                               "batching": cfg.batching},
                     "app": "digits RewardConfig() (3 members + gold)", "cpus": os.cpu_count(),
                     "machine": platform.machine(), "python": platform.python_version(), "ray": ray.__version__,
                     "torch": torch.__version__},
           "phases": rows, "recovery": rec,
           "valid_errors": [{"start_s": round(t, 3), "latency_s": round(lat, 3), "status": str(st),
                             "reply": soak.details.get(i)} for i, (t, lat, st) in enumerate(soak.valid) if st != 200],
           "timeline": tl}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    plot(soak, spans, rec, tl, args, args.out.with_suffix(".png"))

    def ms(d: dict | None, key: str) -> str:
        return f"{d[key]:7.0f}" if d and d.get(key) is not None else "      -"

    print(f"{'phase':28} {'s':>11} {'ok/req':>11} {'p50 ms':>7} {'p99 ms':>7}  {'hz p50':>7} {'hz p99':>7} "
          f"{'hz max':>7}  errors | slow outcomes")
    for r in rows:
        hz = r["healthz"]["latency_ms"]
        print(f"{r['phase']:28} {r['from_s']:5.0f}-{r['to_s']:<5.0f} {r['ok']:5}/{r['requests']:<5} "
              f"{ms(r['latency_ms'], 'p50')} {ms(r['latency_ms'], 'p99')}  {ms(hz, 'p50')} {ms(hz, 'p99')} "
              f"{ms(hz, 'max')}  {r['errors'] or '-'} | {r['slow_connections']['outcomes'] or '-'}")
    if rec is not None:
        replaced = rec.get("replaced_after_s")
        recovered = rec["recovered_after_s"]
        print(f"killed {rec['replica']} at {rec['at_s']:.1f} s: new replica after "
              f"{'-' if replaced is None else f'{replaced:.1f} s'}, {rec['recovery_run']} consecutive successes after "
              f"{'-' if recovered is None else f'{recovered:.1f} s'}, errors until then {rec['errors_until_recovered'] or '-'}"
              f"; slowest /healthz after it {ms(rec, 'healthz_max_ms_after_kill').strip()} ms")


if __name__ == "__main__":
    main()
