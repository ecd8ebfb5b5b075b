"""The arith testbed's data and scoring halves: problems, tokenizer, verifiers (exact, never crashing)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from steadyrl.reward.verifiers import VerifierReward, verify_addition, verify_sudoku
from steadyrl.rollout.arith import TOKENIZER, ArithTask, sudoku_solutions, sudoku_units_ok


def test_problems_are_a_pure_function_of_seed_and_index():
    task = ArithTask(digits=3, gen_length=5)
    assert task.problems(7, range(5)) == task.problems(7, range(5))
    assert task.problems(7, range(5)) != task.problems(8, range(5))
    p = task.problem(7, 3)
    a, b = p.prompt.rstrip("=").split("+")
    assert len(a) == len(b) == 3 and int(p.answer) == int(a) + int(b)


def test_encoding_has_fixed_lengths_and_round_trips():
    task = ArithTask()
    problems = task.problems(0, range(20))
    prompts, completions = task.encode_prompts(problems), task.encode_completions(problems)
    assert prompts.shape == (20, task.prompt_length) and completions.shape == (20, task.gen_length)
    for p, row, comp in zip(problems, prompts, completions):
        assert TOKENIZER.decode(row) == p.prompt and TOKENIZER.decode(comp) == p.answer
        assert comp[len(p.answer):].eq(TOKENIZER.eos_id).all()
    with pytest.raises(ValueError, match="shorter than the longest"):
        ArithTask(digits=3, gen_length=3)
    with pytest.raises(ValueError, match=r"\['x'\]"):
        TOKENIZER.encode("1x2")


def test_there_are_288_sudoku_grids_all_valid_and_distinct():
    grids = sudoku_solutions()
    assert len(grids) == len(set(grids)) == 288
    assert all(all(sudoku_units_ok(g)) for g in grids)


def test_addition_verifier_is_exact():
    assert verify_addition("07+45=", "52") == 1.0
    assert verify_addition("07+45=", "53") == 0.0
    assert verify_addition("07+45=", "052") == 0.0  # a leading zero is not the canonical answer
    assert verify_addition("99+99=", "198") == 1.0


def test_sudoku_verifier_checks_rules_and_givens_with_optional_partial_credit():
    task = ArithTask(task="sudoku", gen_length=16)
    p = task.problem(0, 0)
    assert verify_sudoku(p.prompt, p.answer) == 1.0
    other = next(g for g in sudoku_solutions() if g != p.answer)
    givens = p.prompt.rstrip("=").replace("|", "")
    if any(gv != "0" and gv != c for gv, c in zip(givens, other)):
        assert verify_sudoku(p.prompt, other) == 0.0  # a valid grid that changes a given cell
    # swap two blank cells of one row: the row stays valid, some columns break -> partial credit only
    blanks = [i for i, c in enumerate(givens) if c == "0"]
    pair = next((i, j) for i, j in itertools.combinations(blanks, 2) if i // 4 == j // 4 and p.answer[i] != p.answer[j])
    wrong = list(p.answer)
    wrong[pair[0]], wrong[pair[1]] = wrong[pair[1]], wrong[pair[0]]
    wrong = "".join(wrong)
    assert verify_sudoku(p.prompt, wrong) == 0.0
    credit = verify_sudoku(p.prompt, wrong, partial_credit=True)
    assert credit == sum(sudoku_units_ok(wrong)) / 12 and 0 < credit < 1


def test_malformed_output_scores_zero_and_never_raises():
    rng = random.Random(0)
    alphabet = "0123456789+=|abc <>"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        assert verify_addition("07+45=", text) in (0.0, 1.0)
        assert verify_sudoku("1200|0000|0000|0000=", text, partial_credit=True) == 0.0 or len(text) == 16
    assert verify_addition("not a prompt", "52") == 0.0
    # token ids of anything, including specials and the mask token, score 0 through the reward model
    reward = VerifierReward()
    ids = torch.randint(0, len(TOKENIZER), (64, 4), generator=torch.Generator().manual_seed(0))
    prompts = ArithTask().encode_prompts(ArithTask().problems(0, range(64)))
    scores = reward.score(ids, prompts)
    assert scores.shape == (64,) and set(scores.tolist()) <= {0.0, 1.0}
    good = ArithTask().encode_completions(ArithTask().problems(0, range(64)))
    assert reward.score(good, prompts).eq(1).all() and reward.correct(good, prompts).eq(1).all()


def test_verifier_features_measure_hamming_distance():
    a = torch.tensor([[3, 4, 2, 2], [3, 5, 2, 2], [6, 7, 8, 2]])
    f = VerifierReward().features(a)
    d2 = torch.cdist(f, f) ** 2 / 2
    assert torch.allclose(d2, torch.tensor([[0.0, 1, 3], [1, 0, 3], [3, 3, 0]]), atol=1e-5)


def test_the_sudoku_task_pretrains_samples_and_trains_in_process(tmp_path):
    """The harder task end to end in one process (a short pre-training: the path, not the accuracy)."""
    from steadyrl.services.config import CONFIG_DIR, load_config
    from tests.helpers import train_local

    overrides = ["testbed.pretrain.iterations=10", "testbed.pretrain.batch_size=16", "run.steps=1",
                 "testbed.eval_problems=6", "testbed.prompts_per_step=2", "sampler.group_size=4",
                 "learner.micro_batch_size=8", "learner.optim_batch_size=8"]
    cfg = load_config(CONFIG_DIR / "arith-sudoku-grpo.yaml", overrides)
    result, rows = train_local(CONFIG_DIR / "arith-sudoku-grpo.yaml", tmp_path / "run", overrides)
    assert result.steps_done == 1 and len(rows) == 1
    assert result.final_eval["breakdown"] == {"16-digit answers": result.final_eval["held_out"]}
    # what the run trains on (the partial-credit verifier) and monitors (the exact one), through the ensemble its
    # testbed builds: exact values on hand-built completions of the run's first training prompt
    from steadyrl.services.testbeds import build_testbed

    testbed = build_testbed(cfg)
    prompts, _ = testbed.train_prompts(0, 1, 0)
    problem = testbed.task.problems(cfg.testbed.train_seed, [0])[0]
    answer, givens = problem.answer, problem.prompt.rstrip("=").replace("|", "")
    assert TOKENIZER.decode(prompts[0]) == problem.prompt
    blanks = [i for i, c in enumerate(givens) if c == "0"]
    # two blank cells of one row with different digits, swapped: the row stays valid, their 2 columns break, and
    # their 2 boxes too unless both cells are in one box -> 10/12 or 8/12 of the units valid
    i, j = next((i, j) for i, j in itertools.combinations(blanks, 2) if i // 4 == j // 4 and answer[i] != answer[j])
    swapped = list(answer)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    credit = (12 - 2 - (0 if i % 4 // 2 == j % 4 // 2 else 2)) / 12
    given = next(k for k, c in enumerate(givens) if c != "0")
    changed = answer[:given] + "1234"[("1234".index(answer[given]) + 1) % 4] + answer[given + 1:]
    completions = [answer, "".join(swapped), changed, answer[:7] + "+" + answer[8:], "5" + answer[1:]]
    ids = torch.tensor([TOKENIZER.encode(c) for c in completions])
    scores = testbed.reward_ensemble().score_all(ids, prompts[:1].expand(len(ids), -1))
    assert scores.reward.tolist() == pytest.approx([1.0, credit, 0.0, 0.0, 0.0], abs=1e-7)
    assert scores.monitors["exact_correct"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
