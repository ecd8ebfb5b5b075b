"""`steadyrl inspect`'s one-page HTML report: self-contained (every picture a base64 data URI, no script, no
external file), so it can be mailed or attached to a ticket. Rendered with jinja2, autoescaped."""
from __future__ import annotations

import base64
from pathlib import Path

import jinja2

from steadyrl.services.run_folder.reader import MetricSummary, RunFolder, Verdict

TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<link rel="icon" href="data:,">
<title>steadyrl report: {{ run.name }}</title>
<style>
body { font-family: sans-serif; margin: 1.5em auto; padding: 0 1em; max-width: 1300px; color: #222; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
pre { background: #f6f6f6; padding: .6em; overflow-x: auto; font-size: 12px; }
img { max-width: 100%; }
.verdict { padding: .6em 1em; border-radius: 4px; font-weight: bold; }
.suspected { background: #fdd; } .clean { background: #dfd; } .unknown { background: #eee; }
.rule { font-size: 13px; color: #555; }
</style></head>
<body>
<h1>{{ run.name }}</h1>
<p>{{ run.path }} &middot; {{ run.metrics | length }} logged steps &middot; {{ run.evals | length }} evaluations</p>

<h2>Reward hacking</h2>
<p class="verdict {{ verdict_class }}">{{ verdict.text }}</p>
<p class="rule">Rule: {{ verdict.rule }}.</p>

<h2>Key metrics</h2>
{% if summary %}<table><tr><th>metric</th><th>last</th><th>min (step)</th><th>max (step)</th></tr>
{% for m in summary %}<tr><td>{{ m.key }}</td><td>{{ fmt(m.last) }}</td><td>{{ fmt(m.min) }} ({{ m.min_step }})</td>
<td>{{ fmt(m.max) }} ({{ m.max_step }})</td></tr>
{% endfor %}</table>{% else %}<p>No metrics logged yet.</p>{% endif %}

{% if run.recoveries %}<h2>Restarts after a lost process or node</h2>
<table><tr><th>restart</th><th>failed at step</th><th>resumed from</th><th>steps redone</th><th>recovery (s)</th>
<th>cause</th></tr>
{% for r in run.recoveries %}<tr><td>{{ r.restart }}</td><td>{{ r.failed_step }}</td><td>{{ r.resumed_from_step }}</td>
<td>{{ r.steps_redone }}</td><td>{{ fmt(r.recovery_s) }}</td><td>{{ r.cause }}</td></tr>
{% endfor %}</table>{% endif %}

<h2>Rollbacks and anomaly events</h2>
{% if run.rollbacks %}<table><tr><th>rollback</th><th>detected at step</th><th>restored step</th><th>lr scale</th>
<th>reasons</th></tr>
{% for r in run.rollbacks %}<tr><td>{{ r.rollback }}</td><td>{{ r.step }}</td><td>{{ r.restored_step }}</td>
<td>{{ fmt(r.lr_scale) }}</td><td>{{ r.reasons | join("; ") }}</td></tr>
{% endfor %}</table>{% else %}<p>No rollbacks.</p>{% endif %}
{% if run.anomalies %}<table><tr><th>step</th><th>kind</th><th>value</th><th>threshold</th><th>KL boost</th>
<th>until step</th><th>saved batch</th></tr>
{% for a in run.anomalies %}<tr><td>{{ a.step }}</td><td>{{ a.kind }}</td><td>{{ fmt(a.value) }}</td>
<td>{{ fmt(a.threshold) }}</td><td>{{ fmt(a.kl_boost) }}</td><td>{{ a.until_step }}</td><td>{{ a.batch }}</td></tr>
{% endfor %}</table>{% else %}<p>No anomaly events.</p>{% endif %}

<h2>Curves</h2>
{% if dashboard %}<img alt="training-health dashboard" src="{{ dashboard }}">{% else %}<p>No curves yet.</p>{% endif %}

<h2>Evaluations</h2>
{% for e in evals %}<h3>step {{ e.step }}</h3>
<p>held-out (gold) {{ fmt(e.held_out) }} &middot; proxy {{ fmt(e.proxy_mean) }} &middot;
diversity (nn) {{ fmt(e.diversity_nn) }}</p>
{% for s in e.samples %}{% if s.image %}<img alt="samples at step {{ e.step }}" src="{{ s.image }}">
{% else %}<pre>{{ s.text }}</pre>{% endif %}{% endfor %}
{% else %}<p>No evaluations yet.</p>{% endfor %}

<h2>Config</h2>
<pre>{{ run.config_text }}</pre>
</body></html>
"""


def data_uri(path: Path, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def render_report(run: RunFolder, summary: list[MetricSummary], verdict: Verdict, dashboard: Path | None) -> str:
    """The page's HTML: verdict and its rule, key metrics, events, the dashboard, each eval's samples, config."""
    evals = []
    for e in run.evals:
        samples = []
        for f in run.samples.get(int(e["step"]), []):
            if f.suffix == ".png":
                samples.append({"image": data_uri(f)})
            else:
                samples.append({"text": f.read_text(errors="replace")})
        evals.append({**e, "samples": samples})
    env = jinja2.Environment(autoescape=True)  # a field missing from a hand-edited file renders empty
    env.globals["fmt"] = _fmt
    verdict_class = {None: "unknown", True: "suspected", False: "clean"}[verdict.suspected]
    return env.from_string(TEMPLATE).render(run=run, summary=summary, verdict=verdict, verdict_class=verdict_class,
                                            dashboard=data_uri(dashboard) if dashboard else None, evals=evals)


def write_report(run: RunFolder, summary: list[MetricSummary], verdict: Verdict, dashboard: Path | None,
                 path: Path) -> Path:
    path.write_text(render_report(run, summary, verdict, dashboard), encoding="utf-8")
    return path

