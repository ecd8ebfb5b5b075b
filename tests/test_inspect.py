"""`steadyrl inspect` / `steadyrl compare` on one real short run folder (the product loop, local runtime): the
printed tables against the metrics file, the dashboard's event marks, the self-contained HTML report (also
rendered in a real headless Chromium), the reward-hacking rule, and bad input."""
from __future__ import annotations

import base64
import html
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from steadyrl.services.config import CONFIG_DIR
from steadyrl.services.driver.cli import app
from steadyrl.services.run_folder.inspection import inspect_run
from steadyrl.services.run_folder.reader import HackingRule, hacking_verdict, load_run

ROLLBACK = {"step": 2, "restored_step": 1, "reasons": ["grad_norm spike", "reward drop"], "lr_scale": 0.5,
            "rollback": 1}
ANOMALY = {"step": 3, "kind": "proxy_gold_gap", "value": 0.4, "threshold": 0.25, "kl_boost": 10.0,
           "until_step": 8, "batch": "anomalies/step_0003"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """4 digits steps, evaluated at 0, 2 and 4 (one process, no Ray: ~35 s)."""
    from tests.helpers import train_local

    result, rows = train_local(CONFIG_DIR / "smoke.yaml", tmp_path_factory.mktemp("inspect") / "run",
                               ["run.steps=4", "run.eval_every=2", "run.checkpoint_every=4", "sampler.group_size=4",
                                "testbed.eval_samples_per_class=2"])
    assert len(rows) == 4
    return result.run_dir


def copy_run(run_dir: Path, dest: Path, events: bool = False) -> Path:
    """The run folder without its checkpoints; with `events`, one hand-written rollback and anomaly event."""
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("checkpoints", "report"))
    if events:
        (dest / "rollbacks.jsonl").write_text(json.dumps(ROLLBACK) + "\n")
        (dest / "anomalies.jsonl").write_text(json.dumps(ANOMALY) + "\n")
    return dest


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def not_blank(png: bytes | Path) -> np.ndarray:
    img = np.asarray(Image.open(io.BytesIO(png) if isinstance(png, bytes) else png).convert("L"), dtype=float)
    assert img.std() > 10, "the picture is blank"
    return img


def invoke(*args: str):
    return CliRunner().invoke(app, [*args], env={"COLUMNS": "200"})


def table_row(output: str, first_cell: str) -> list[str]:
    """The cells of the rich table row whose first cell is `first_cell`."""
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row {first_cell!r} in:\n{output}")


def test_inspect_tabulates_the_metrics_file_and_writes_the_dashboard_and_report(run_dir, tmp_path):
    out = tmp_path / "report"
    res = invoke("inspect", str(run_dir), "--out", str(out))
    assert res.exit_code == 0, res.output
    rows = rows_of(run_dir)
    for key in ("reward/train_mean", "policy/grad_norm", "policy/kl_ref_monitor", "diversity/nn_distance",
                "policy/ratio_max", "health/adv_std"):
        values = [r[key] for r in rows]
        lo, hi = min(values), max(values)
        expected = [key, f"{values[-1]:.4g}", f"{lo:.4g} ({rows[values.index(lo)]['step']})",
                    f"{hi:.4g} ({rows[values.index(hi)]['step']})"]
        assert table_row(res.output, key) == expected
    evals = json.loads((run_dir / "evals.json").read_text())
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert table_row(res.output, "held-out (gold)") == ["held-out (gold)", f"{evals[0]['held_out']:.4g}",
                                                        f"{evals[-1]['held_out']:.4g}"]
    assert "events: 0 rollback(s), 0 anomaly event(s)" in res.output
    assert hacking_verdict(evals).text in res.output and "rule: reward hacking is suspected when" in res.output
    assert not_blank(out / "dashboard.png").shape[1] > 1000
    assert (out / "report.html").is_file()
    # default output folder: RUN_DIR/report
    copy = copy_run(run_dir, tmp_path / "copy")
    assert invoke("inspect", str(copy)).exit_code == 0
    assert {p.name for p in (copy / "report").iterdir()} == {"dashboard.png", "report.html"}


def test_the_report_is_one_self_contained_page_with_every_eval_grid_and_the_config(run_dir, tmp_path):
    ins = inspect_run(copy_run(run_dir, tmp_path / "run", events=True), tmp_path / "out")
    page = ins.report.read_text()
    for step in (0, 2, 4):  # the testbed's sample grids, embedded byte for byte
        grid = (ins.run.path / f"samples_step_{step:04d}.png").read_bytes()
        assert f'src="data:image/png;base64,{base64.b64encode(grid).decode()}"' in page
    assert base64.b64encode((tmp_path / "out" / "dashboard.png").read_bytes()).decode() in page
    assert html.escape(ins.run.config_text) in page
    assert html.escape(ins.verdict.text) in page and html.escape(ins.verdict.rule) in page
    # nothing outside the file: every src/href is a data URI
    assert re.findall(r'(?:src|href)="([^"]*)"', page) and all(
        u.startswith("data:") for u in re.findall(r'(?:src|href)="([^"]*)"', page))
    cells = lambda row: re.sub(r"\s+", " ", row)  # noqa: E731
    assert cells("<td>1</td><td>2</td><td>1</td> <td>0.5</td><td>grad_norm spike; reward drop</td>") in cells(page)
    assert cells("<td>3</td><td>proxy_gold_gap</td><td>0.4</td> <td>0.25</td><td>10</td><td>8</td>"
                 "<td>anomalies/step_0003</td>") in cells(page)


def test_text_examples_of_a_language_testbed_are_shown_as_preformatted_text(run_dir, tmp_path):
    run = copy_run(run_dir, tmp_path / "run")
    for f in run.glob("samples_step_*.png"):
        f.unlink()
    (run / "samples_step_0002.txt").write_text("step 2: exact 50%\n\nok  3+4=7\nXX  <b>2*5</b>=11\n")
    page = inspect_run(run, tmp_path / "out").report.read_text()
    assert "<pre>step 2: exact 50%\n\nok  3+4=7\nXX  &lt;b&gt;2*5&lt;/b&gt;=11\n</pre>" in page


def test_rollbacks_and_anomalies_are_listed_and_marked_on_every_panel(run_dir, tmp_path):
    import matplotlib.pyplot as plt

    from steadyrl.services.run_folder.dashboard import dashboard_figure

    run = copy_run(run_dir, tmp_path / "run", events=True)
    res = invoke("inspect", str(run))
    assert res.exit_code == 0, res.output
    assert "events: 1 rollback(s), 1 anomaly event(s)" in res.output
    assert table_row(res.output, "2")[1:] == ["rollback 1", "restored step 1, lr scale 0.5: grad_norm spike; "
                                                            "reward drop"]
    assert table_row(res.output, "3")[1] == "anomaly proxy_gold_gap"
    fig = dashboard_figure(load_run(run))
    drawn = [ax for ax in fig.axes if ax.get_title()]
    assert len(drawn) >= 8
    for ax in drawn:
        vertical = {(float(line.get_xdata()[0]), line.get_color(), line.get_linestyle()) for line in ax.lines
                    if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2}
        assert vertical == {(2.0, "tab:red", "-"), (3.0, "tab:orange", "--")}, ax.get_title()
    plt.close(fig)


def test_compare_overlays_runs_labelled_by_folder_and_tabulates_their_final_values(run_dir, tmp_path):
    a, b = run_dir, copy_run(run_dir, tmp_path / "lower_lr")
    rows = rows_of(b)
    for r in rows:
        r["reward/train_mean"] -= 0.25
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp"
    res = invoke("compare", str(a), str(b), "--out", str(out), "--metric", "reward/train_mean",
                 "--metric", "eval/held_out")
    assert res.exit_code == 0, res.output
    final = rows_of(a)[-1]["reward/train_mean"]
    held = json.loads((a / "evals.json").read_text())[-1]["held_out"]
    assert table_row(res.output, a.name)[:4] == [a.name, "4", f"{final:.4g}", f"{held:.4g}"]
    assert table_row(res.output, "lower_lr")[:4] == ["lower_lr", "4", f"{final - 0.25:.4g}", f"{held:.4g}"]
    not_blank(out / "compare.png")
    # the defaults: only keys some run has
    res = invoke("compare", str(a), str(b), "--out", str(out))
    assert res.exit_code == 0 and "policy/kl_ref_monitor" in res.output
    res = invoke("compare", str(a), str(b), "--metric", "reward/no_such_key", "--out", str(out))
    assert res.exit_code == 2 and "--metric reward/no_such_key: no run logged it" in res.output


def evals(proxy: tuple[float, float], gold: tuple[float, float], div: tuple[float, float]) -> list[dict]:
    return [{"step": s, "proxy_mean": p, "held_out": g, "diversity_nn": d, "breakdown": {}}
            for s, p, g, d in zip((0, 10), proxy, gold, div)]


def test_the_hacking_verdict_follows_its_stated_rule():
    rule = HackingRule(min_proxy_gain=0.25, min_gold_drop=0.25, max_diversity_drop=0.5)
    hacked = hacking_verdict(evals((0.5, 0.75), (0.75, 0.5), (8, 8)), rule)
    assert hacked.suspected is True and (hacked.proxy_gain, hacked.gold_drop) == (0.25, 0.25)
    assert hacked.text == "reward hacking suspected (step 0 -> 10): proxy +0.250 while gold -0.250"
    assert hacking_verdict(evals((0.5, 0.75), (0.75, 0.5625), (8, 8)), rule).suspected is False  # gold: too little
    assert hacking_verdict(evals((0.5, 0.625), (0.75, 0.25), (8, 8)), rule).suspected is False  # proxy: too little
    collapsed = hacking_verdict(evals((0.5, 0.5), (0.75, 0.75), (8, 3)), rule)  # diversity -62.5% alone
    assert collapsed.suspected is True and collapsed.text.endswith("diversity fell 62%")
    assert hacking_verdict(evals((0.5, 0.5), (0.75, 0.75), (8, 4)), rule).suspected is False  # exactly -50%
    assert hacking_verdict(evals((0.5, 0.5), (0.75, 0.75), (8, 4))[:1], rule).suspected is None
    assert "rose by >= 0.25 while the held-out (gold) score fell by >= 0.25" in rule.statement()
    assert "fell by more than 50%" in rule.statement()


def test_inspect_gives_the_verdict_of_a_hand_made_evals_file_and_its_thresholds_are_options(tmp_path):
    run = tmp_path / "handmade"
    run.mkdir()
    (run / "config.yaml").write_text("run:\n  name: handmade\n")
    (run / "evals.json").write_text(json.dumps(evals((0.5, 0.75), (0.75, 0.5), (8, 8))))
    res = invoke("inspect", str(run))
    assert res.exit_code == 0, res.output
    assert "reward hacking suspected (step 0 -> 10): proxy +0.250 while gold -0.250" in res.output
    assert {p.name for p in (run / "report").iterdir()} == {"dashboard.png", "report.html"}  # the eval curves
    res = invoke("inspect", str(run), "--min-gold-drop", "0.3")
    assert res.exit_code == 0 and "no sign of reward hacking" in res.output
    res = invoke("inspect", str(run), "--max-diversity-drop", "1.5")
    assert res.exit_code == 2 and "--max-diversity-drop: Input should be less than or equal to 1" in res.output


def test_a_folder_that_is_not_a_run_is_refused_naming_it(run_dir, tmp_path):
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    for args in (["inspect", str(empty)], ["compare", str(run_dir), str(empty)],
                 ["inspect", str(tmp_path / "missing")]):
        res = invoke(*args)
        assert res.exit_code == 2, res.output
        assert f"error: {args[-1]} is not a run folder" in res.output
    res = invoke("compare", str(run_dir))
    assert res.exit_code == 2 and "at least two run folders" in res.output


def test_the_report_renders_in_headless_chromium_without_console_errors(run_dir, tmp_path):
    """The real browser (Debian's chromium, driven by playwright): the page loads from file://, every picture
    decodes, nothing is logged as an error, and the screenshot is not blank."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "no chromium on PATH: install it (`apt-get install -y chromium`; `make install-test` does)"
    from playwright.sync_api import sync_playwright

    ins = inspect_run(copy_run(run_dir, tmp_path / "run", events=True), tmp_path / "out")
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
        page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url}"))
        page.goto(ins.report.as_uri(), wait_until="load")
        images = page.eval_on_selector_all("img", "els => els.map(e => [e.complete, e.naturalWidth])")
        title = page.title()
        shot = page.screenshot(full_page=True)
        browser.close()
    assert problems == []
    assert title == f"steadyrl report: {ins.run.name}"
    assert len(images) == 1 + 3 and all(done and width > 100 for done, width in images)  # dashboard + 3 grids
    img = not_blank(shot)
    assert img.shape[1] == 1280 and img.shape[0] > 2000  # the whole page: curves, grids and config


def test_restarts_after_a_lost_node_are_tabulated_with_what_they_cost(run_dir, tmp_path):
    from steadyrl.services.run_folder.recoveries import RECOVERIES_LOG

    run = copy_run(run_dir, tmp_path / "run")
    assert "restart(s)" not in invoke("inspect", str(run)).output  # a run that never restarted shows none
    lost = [{"restart": 1, "failed_step": 4, "resumed_from_step": 2, "steps_redone": 2, "recovery_s": 31.5,
             "cause": "the learner died during step 4 (node lost)"},
            {"restart": 2, "failed_step": 4, "resumed_from_step": 4, "steps_redone": 0, "recovery_s": 12.25,
             "cause": "rollout worker 0 failed 4 times in a row"}]
    (run / RECOVERIES_LOG).write_text("".join(json.dumps(r) + "\n" for r in lost))
    res = invoke("inspect", str(run))
    assert res.exit_code == 0, res.output
    assert "2 restart(s) after a lost process or node: 2 step(s) redone, 44 s recovering" in " ".join(res.output.split())
    assert table_row(res.output, "1")[1:5] == ["4", "2", "2", "31.5"]
    report = (run / "report" / "report.html").read_text()
    assert "Restarts after a lost process or node" in report and "the learner died during step 4 (node lost)" in report
