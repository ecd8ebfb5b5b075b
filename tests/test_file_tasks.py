"""Tasks from files through the arith testbed: rows split and encoded, verified per kind, trained by the one loop,
scored over HTTP by the Serve verifier; bad files and prompts fail before Ray starts, naming the row."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.rollout.task_file_dataset import FileTask, FileTaskSettings
from steadyrl.services.config import CONFIG_DIR, load_config
from steadyrl.services.testbeds import build_testbed
from tests.helpers import train_local

FILE_TASK = ["testbed.task=file", "testbed.file.task_file=arith_addition", "testbed.eval_problems=200"]


def file_testbed(*overrides: str):
    return build_testbed(load_config(CONFIG_DIR / "arith-grpo.yaml", [*FILE_TASK, *overrides]))


def test_rows_split_into_disjoint_training_and_held_out_sets_and_draws_agree_across_workers():
    task = FileTask(FileTaskSettings(task_file="arith_addition"), TOKENIZER, eval_rows=100, split_seed=303)
    train, held_out = task.splits
    assert len(train) == 300 and len(held_out) == 100
    assert not {r.question for r in train} & {r.question for r in held_out}
    ids = list(range(0, 700))  # more than two passes over the 300 training rows
    drawn = task.train_indices(202, ids)
    assert sorted(drawn[:300]) == list(range(300)) and sorted(drawn[300:600]) == list(range(300))
    assert drawn[:300] != drawn[300:600]  # a fresh permutation per pass
    assert task.train_indices(202, ids[40:47]) == drawn[40:47]  # any worker's share draws the same rows
    prompts = task.train_prompts(202, [0, 1])
    assert prompts.shape == (2, task.width) and TOKENIZER.decode(prompts[0]) == train[drawn[0]].question


def test_the_verifier_finds_each_prompts_answer_by_ids_and_by_text():
    from steadyrl.reward.verifiers import VerifierReward

    testbed = file_testbed()
    verifier = VerifierReward.from_spec(testbed.reward_spec().members[0])
    rows = testbed.file_task.splits[1][:3]
    prompts = testbed.eval_prompts()[:3]  # left-padded token ids, as a training batch carries them
    answers = torch.tensor([TOKENIZER.encode(r.answer) + [TOKENIZER.eos_id] * (4 - len(r.answer)) for r in rows])
    assert verifier.score(answers, prompts).tolist() == [1.0, 1.0, 1.0]
    assert verifier.score(answers.flip(0), prompts).tolist() != [1.0, 1.0, 1.0]
    texts = [r.question for r in rows]
    assert verifier.score_texts(texts, [r.answer for r in rows]).tolist() == [1.0, 1.0, 1.0]
    assert verifier.score_texts(texts, ["so \\boxed{" + r.answer + "}" for r in rows]).tolist() == [1.0, 1.0, 1.0]
    assert verifier.score_texts(["not a row"], ["5"]).tolist() == [0.0]


def test_a_file_task_trains_in_process_and_fixes_a_quarter_of_the_held_out_errors(tmp_path):
    """The arith preset on the shipped addition file (400 rows; 200 held out), tiny model pre-trained on synthetic
    addition: the same margin the synthetic task's learning test holds."""
    result, rows = train_local(CONFIG_DIR / "arith-grpo.yaml", tmp_path / "run",
                               [*FILE_TASK, "run.steps=24", "run.eval_every=24"])
    base, final = result.base_eval, result.final_eval
    assert base["n_samples"] == final["n_samples"] == 200
    print(f"file task held-out exact match: {base['held_out']:.3f} -> {final['held_out']:.3f}")
    assert 1 - final["held_out"] <= 0.75 * (1 - base["held_out"]), (base["held_out"], final["held_out"])


def test_the_file_verifier_app_scores_over_http(ray_cluster, serve_port):
    from ray import serve

    from steadyrl.services.serving import APP_NAME, ROUTE_PREFIX, deploy_reward_app

    testbed = file_testbed()
    row = testbed.file_task.splits[0][0]
    deploy_reward_app(testbed)
    url = f"http://127.0.0.1:{serve_port}{ROUTE_PREFIX}"
    try:
        body = {"prompts": [row.question, row.question, "99+99="], "completions": [row.answer, "1000", "198"]}
        out = httpx.post(f"{url}/score_text", json=body, timeout=60).json()
        assert out["reward"] == [1.0, 0.0, 0.0]  # "99+99=" is no row of the file: scored 0
        ids = {"samples": [{"prompt": TOKENIZER.encode(row.question), "completion": row.answer}]}
        assert httpx.post(f"{url}/v1/score", json=ids, timeout=60).json()["reward"] == [1.0]
    finally:
        serve.delete(APP_NAME)  # the session's other tests expect the digits ensemble under this name


# ------------------------------------------------------------------------------------------ bad input
def test_a_task_file_row_without_its_answer_fails_when_the_config_loads(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "01+02=", "answer": "3"}) + "\n" + json.dumps({"question": "02+02="}) + "\n")
    with pytest.raises(ValueError, match=r"line 2.*answer"):
        load_config(CONFIG_DIR / "arith-grpo.yaml", ["testbed.task=file", f"testbed.file.task_file={bad}"])
    with pytest.raises(ValueError, match="testbed.task=file needs testbed.file.task_file"):
        load_config(CONFIG_DIR / "arith-grpo.yaml", ["testbed.task=file"])


def test_a_prompt_longer_than_the_limit_fails_before_ray_starts_naming_its_row():
    testbed = file_testbed("testbed.max_prompt_length=5")
    with pytest.raises(ValueError, match=r"row 0 of 'arith_addition'.*6 tokens, longer than .*max_prompt_length=5"):
        testbed.preflight()
    chars = file_testbed("testbed.file.task_file=math_tiny", "testbed.eval_problems=5")
    with pytest.raises(ValueError, match="cannot be encoded: characters"):
        chars.preflight()  # word problems in the character tokenizer's digits-only vocabulary
