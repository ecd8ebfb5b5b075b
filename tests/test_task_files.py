"""Task files (math / countdown / sudoku) and their answer verifiers: loading, prompts, scoring."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from steadyrl.reward import math_answers
from steadyrl.reward.answer_verifiers import verify_answer
from steadyrl.reward.countdown_answers import evaluate_equation, verify_countdown
from steadyrl.reward.math_answers import extract_final_answer, verify_math
from steadyrl.reward.sudoku_answers import solve_sudoku, verify_sudoku
from steadyrl.rollout.task_file_reader import TaskRow, load_task_file, render_prompt, shipped_task_files

VERIFIER_OF = {"math_tiny": "math", "countdown_tiny": "countdown", "sudoku_tiny": "sudoku", "arith_addition": "math"}


def write_jsonl(tmp_path, lines, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def in_thread(fn, *args):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join(120)
    assert out, "the call did not return"
    return out[0]


# ------------------------------------------------------------------------------------------- loading
def test_jsonl_rows_keep_other_fields_as_metadata_skip_blank_lines_and_stringify_numeric_answers(tmp_path):
    path = write_jsonl(tmp_path, [{"question": " 2+2? ", "answer": 4}, "", "   ",
                                  {"question": "half", "answer": 0.5, "level": 1},
                                  {"question": "cd", "answer": "8*3", "numbers": [8, 3], "target": 24}])
    rows = load_task_file(path)
    assert rows == (TaskRow("2+2?", "4", {}), TaskRow("half", "0.5", {"level": 1}),
                    TaskRow("cd", "8*3", {"numbers": [8, 3], "target": 24}))


def test_configured_field_names_are_used(tmp_path):
    path = write_jsonl(tmp_path, [{"problem": "p", "solution": "\\frac{1}{2}", "question": "kept"}])
    assert load_task_file(path, question_field="problem", answer_field="solution") == (
        TaskRow("p", "\\frac{1}{2}", {"question": "kept"}),)


def test_a_row_missing_the_answer_field_is_an_error_naming_line_and_field(tmp_path):
    path = write_jsonl(tmp_path, [{"question": "a", "answer": "1"}, "", {"question": "b"}])
    with pytest.raises(ValueError, match=r"t\.jsonl, line 3: missing field 'answer'"):
        load_task_file(path)
    with pytest.raises(ValueError, match=r"line 1: missing field 'solution'"):
        load_task_file(path, answer_field="solution")


@pytest.mark.parametrize("line, message", [
    ('{"question": "a", "answer": ', r"line 2: invalid JSON"),
    ('[1, 2]', r"line 2: expected a JSON object"),
    ('{"question": "", "answer": "1"}', r"line 2: field 'question' is empty"),
    ('{"question": 7, "answer": "1"}', r"line 2: field 'question' must be a string"),
    ('{"question": "q", "answer": ""}', r"line 2: field 'answer' is empty"),
    ('{"question": "q", "answer": [1]}', r"line 2: field 'answer' must be a string or a number"),
    ('{"answer": "1"}', r"line 2: missing field 'question'"),
])
def test_bad_rows_are_errors_naming_the_file_line_and_field(tmp_path, line, message):
    path = write_jsonl(tmp_path, ['{"question": "ok", "answer": "1"}', line])
    with pytest.raises(ValueError, match=message) as err:
        load_task_file(path)
    assert str(path) in str(err.value)


def test_missing_file_unsupported_suffix_unknown_name_and_empty_file_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_task_file(tmp_path / "nope.jsonl")
    (tmp_path / "t.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"unsupported extension '\.csv'; supported: \.jsonl, \.parquet"):
        load_task_file(tmp_path / "t.csv")
    with pytest.raises(ValueError, match="unknown task file 'nope'.*math_tiny"):
        load_task_file("nope")
    empty = write_jsonl(tmp_path, ["", "  "], "empty.jsonl")
    with pytest.raises(ValueError, match="empty.jsonl has no rows"):
        load_task_file(empty)


def test_parquet_and_jsonl_load_the_same_rows(tmp_path):
    pd = pytest.importorskip("pandas")
    records = [{"question": "Use [8, 3, 1] to make 24", "answer": "8*3*1", "numbers": [8, 3, 1], "target": 24},
               {"question": "Use [2, 5, 7] to make 17", "answer": "2*5+7", "numbers": [2, 5, 7], "target": 17}]
    pd.DataFrame(records).to_parquet(tmp_path / "t.parquet")
    from_parquet = load_task_file(tmp_path / "t.parquet")
    assert from_parquet == load_task_file(write_jsonl(tmp_path, records))
    assert type(from_parquet[0].metadata["target"]) is int and type(from_parquet[0].metadata["numbers"]) is list


def test_parquet_numeric_answers_become_text_and_a_bad_row_is_named_by_row_number(tmp_path):
    pd = pytest.importorskip("pandas")
    pd.DataFrame({"question": ["a", "b"], "answer": [72.0, 0.5]}).to_parquet(tmp_path / "n.parquet")
    assert [r.answer for r in load_task_file(tmp_path / "n.parquet")] == ["72", "0.5"]
    pd.DataFrame({"question": ["a", None], "answer": ["1", "2"]}).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet, row 2: missing field 'question'"):
        load_task_file(tmp_path / "bad.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="junk.parquet: not a readable parquet file"):
        load_task_file(tmp_path / "junk.parquet")


# ------------------------------------------------------------------------------------------- shipped
def test_shipped_task_files_are_named_by_stem_and_load_by_name():
    shipped = shipped_task_files()
    assert set(VERIFIER_OF) <= set(shipped)
    assert load_task_file("math_tiny") == load_task_file(shipped["math_tiny"])
    sizes = {name: len(load_task_file(name)) for name in VERIFIER_OF}
    assert sizes["math_tiny"] >= 20 and sizes["countdown_tiny"] >= 20 and sizes["sudoku_tiny"] >= 20
    assert sizes["arith_addition"] >= 40


def test_every_shipped_task_row_is_solved_by_its_own_answer():
    for name, kind in VERIFIER_OF.items():
        for row in load_task_file(name):
            assert verify_answer(kind, row.answer, row) == 1.0, (name, row)
            assert verify_answer(kind, f"<answer>{row.answer}</answer>", row) == 1.0, (name, row)


def test_shipped_sudoku_puzzles_have_a_unique_solution_equal_to_the_answer():
    for row in load_task_file("sudoku_tiny"):
        assert solve_sudoku(row.metadata["puzzle"], limit=2) == (row.answer,)


def test_shipped_math_file_has_symbolic_answers_and_countdown_rows_have_3_or_4_numbers():
    answers = [r.answer for r in load_task_file("math_tiny")]
    assert "\\frac{1}{2}" in answers and "\\sqrt{2}" in answers
    assert all(3 <= len(r.metadata["numbers"]) <= 4 for r in load_task_file("countdown_tiny"))


def test_the_addition_file_uses_only_the_arith_characters_and_zero_padded_operands():
    import re

    for row in load_task_file("arith_addition"):
        assert re.fullmatch(r"[0-9]{2}\+[0-9]{2}=", row.question) and set(row.answer) <= set("0123456789")
        a, b = int(row.question[:2]), int(row.question[3:5])
        assert row.answer == str(a + b) and row.metadata == {}


# --------------------------------------------------------------------------------------------- prompts
def tiny_chat_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return fast


def test_chat_template_is_applied_when_the_tokenizer_has_one():
    tok = tiny_chat_tokenizer()
    assert render_prompt("What is 2+2?", tok) == "<|user|>What is 2+2?\n<|assistant|>"
    assert render_prompt("What is 2+2?", tok, system_prompt="Think.") == \
        "<|system|>Think.\n<|user|>What is 2+2?\n<|assistant|>"


def test_without_a_chat_template_the_prompt_is_the_plain_question():
    tok = tiny_chat_tokenizer()
    tok.chat_template = None
    assert render_prompt("07+45=", tok) == "07+45="
    assert render_prompt("07+45=") == "07+45="
    assert render_prompt("Q?", None, system_prompt="Answer in <answer> tags.") == "Answer in <answer> tags.\nQ?"


# ------------------------------------------------------------------------------------------------ math
@pytest.mark.parametrize("text, answer", [
    ("so the answer is \\boxed{18}", "18"),
    ("<answer>\n\\boxed{5}\n</answer>", "5"),
    ("<answer>\n72\n</answer>", "72"),
    ("3 boxes ... #### 72", "72"),
    ("The final answer is 1,000 cookies.", "1000"),
    ("We get 12, then 24, so 36", "36"),
    ("\\boxed{\\frac{1}{2}} and later \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
    ("\\boxed{\\frac{a}{\\frac{b}{c}}}", "\\frac{a}{\\frac{b}{c}}"),
    ("the answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
    ("no numbers here", None),
    ("  \\frac{1}{2} ", "\\frac{1}{2}"),
    ("$2^{10}$.", "2^{10}"),
    ("The answer is $18.", "18"),
    ("The answer is $18 and $5 is the tip.", "18"),
    ("<answer>\nThe total is\n72\n</answer>", "72"),
])
def test_extract_final_answer_prefers_boxed_then_markers_then_the_last_number(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize("completion, answer, score", [
    ("... so the answer is \\boxed{18}", "18", 1.0),
    ("#### 72", "72", 1.0),
    ("\\boxed{19}", "18", 0.0),
    ("", "18", 0.0),
    ("The answer is 18 apples.", "18", 1.0),
    ("\\boxed{18.0}", "18", 1.0),
    ("\\boxed{1/2}", "0.5", 1.0),
    ("answer is 1/2", "1", 0.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.7", 0.0),
    ("Janet ... #### 18", "Janet pays 9*2 = 18 dollars.\n#### 18", 1.0),
])
def test_math_answers_compare_numerically_and_symbolically(completion, answer, score):
    assert verify_math(completion, answer) == score


def test_boxed_fraction_equals_decimal_answer():
    assert verify_math("so x = \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert verify_math("so x = \\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert verify_math("so x = \\boxed{\\dfrac{1}{2}}", 0.5) == 1.0


def test_a_megabyte_of_garbage_scores_zero_quickly():
    junk = ("\\boxed{" + "{(x^" * 50 + "}garbage ") * (1_000_000 // 210)
    for text in (junk, "x" * 1_000_000, "\\boxed{" + "9" * 1_000_000 + "}"):
        start = time.monotonic()
        assert verify_math(text, "18") == 0.0
        assert time.monotonic() - start < 1.0


def test_a_slow_symbolic_answer_times_out_to_zero():
    start = time.monotonic()
    assert verify_math("\\boxed{9^{9^{9^{9}}}}", "18", timeout_s=1) == 0.0
    assert time.monotonic() - start < 10


def test_math_verify_works_off_the_main_thread():
    assert in_thread(verify_math, "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert in_thread(verify_math, "\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
    assert in_thread(verify_math, "\\boxed{\\frac{1}{3}}", "0.5") == 0.0
    start = time.monotonic()
    assert in_thread(verify_math, "\\boxed{9^{9^{9^{9}}}}", "18", 1) == 0.0
    assert time.monotonic() - start < 15
    assert in_thread(verify_math, "\\boxed{\\sqrt{2}}", "\\sqrt{2}") == 1.0  # still works afterwards


@pytest.mark.skipif(os.name != "posix", reason="SIGSTOP")
def test_a_stuck_math_verify_child_is_killed_and_replaced():
    assert in_thread(verify_math, "\\boxed{\\pi}", "\\pi") == 1.0  # starts the child
    proc = math_answers._WORKER._proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)  # as if stuck where no signal timeout reaches
    start = time.monotonic()
    assert in_thread(verify_math, "\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1) == 0.0
    assert time.monotonic() - start < 15
    assert proc.poll() is not None  # killed
    assert in_thread(verify_math, "\\boxed{\\frac{\\pi}{2}}", "\\pi/2") == 1.0  # a fresh child
    assert math_answers._WORKER._proc is not None and math_answers._WORKER._proc.pid != proc.pid


# ------------------------------------------------------------------------------------------- countdown
@pytest.mark.parametrize("completion, score", [
    ("<reasoning>...</reasoning><answer>\n(8-2)*4\n</answer>", 1.0),
    ("<answer>4*(8-2)</answer>", 1.0),
    ("so \\boxed{(8 - 2) * 4}", 1.0),
    ("I think:\n(8-2)*4\n", 1.0),
    ("<answer>8*4-2</answer>", 0.0),  # 30, not 24
    ("<answer>(8-2)*4 = 24</answer>", 0.0),  # '=' is not allowed (d1)
    ("<answer>(8-2)x4</answer>", 0.0),
    ("<answer>(8-2)*4*1</answer>", 0.0),  # a number that was not given
    ("<answer>8/(2-2)*4</answer>", 0.0),  # division by zero
    ("<answer></answer>", 0.0),
])
def test_countdown_follows_d1s_rule(completion, score):
    assert verify_countdown(completion, [8, 2, 4], 24) == score


def test_countdown_rejects_an_equation_that_reuses_a_number():
    assert verify_countdown("<answer>6*4</answer>", [6, 4, 4], 24) == 0.0  # leaves a 4 unused
    assert verify_countdown("<answer>6*2*2</answer>", [6, 2, 5], 24) == 0.0  # uses 2 twice
    assert verify_countdown("<answer>(4+2)*4</answer>", [6, 4, 2], 24) == 0.0  # reuses 4, skips 6
    assert verify_countdown("<answer>6*(4+4-4)</answer>", [6, 4, 4], 24) == 0.0


def test_countdown_division_is_exact_and_format_score_is_d1s_partial_reward():
    assert verify_countdown("<answer>(1+1/3)*18</answer>", [1, 1, 3, 18], 24) == 1.0
    assert verify_countdown("<answer>8*4-2</answer>", "8,2,4", "24", format_score=0.1) == 0.1
    assert verify_countdown("<answer>no equation</answer>", [8, 2, 4], 24, format_score=0.1) == 0.1
    assert verify_countdown("no tagged equation", [8, 2, 4], 24, format_score=0.1) == 0.0
    assert verify_countdown("", [8, 2, 4], 24, format_score=0.1) == 0.0


def test_countdown_never_evaluates_python():
    hostile = "<answer>__import__('os').system('echo pwned')</answer>"
    assert verify_countdown(hostile, [8, 2, 4], 24) == 0.0
    assert evaluate_equation("2**100000") is None and evaluate_equation("(1)(2)") is None
    assert evaluate_equation("(8-2)*4") == 24


# ---------------------------------------------------------------------------------------------- sudoku
PUZZLE_4 = "4312120300003104"
SOLUTION_4 = "4312124324313124"
PUZZLE_9 = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"
SOLUTION_9 = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


def test_sudoku_accepts_a_valid_grid_that_keeps_the_givens():
    assert verify_sudoku(f"<answer>\n{SOLUTION_4}\n</answer>", PUZZLE_4) == 1.0
    spaced = "\n".join(" ".join(SOLUTION_4[r * 4:(r + 1) * 4]) for r in range(4))
    assert verify_sudoku(f"The grid:\n\\boxed{{{spaced}}}", PUZZLE_4) == 1.0
    assert verify_sudoku(SOLUTION_4 + "99", PUZZLE_4) == 1.0  # first N*N digits
    assert verify_sudoku(SOLUTION_9, PUZZLE_9) == 1.0
    assert solve_sudoku(PUZZLE_9) == (SOLUTION_9,)


def test_sudoku_rejects_changed_givens_broken_units_and_short_answers():
    other = "1234341221434321"  # a valid grid, but it changes the givens
    assert verify_sudoku(other, "1030040021000301") == 1.0 and verify_sudoku(other, PUZZLE_4) == 0.0
    broken = SOLUTION_4[:8] + "4231" + SOLUTION_4[12:]  # keeps the givens, repeats 4 in column 0
    assert verify_sudoku(broken, PUZZLE_4) == 0.0
    assert verify_sudoku(SOLUTION_4[:15], PUZZLE_4) == 0.0
    assert verify_sudoku(SOLUTION_9[:80], PUZZLE_9) == 0.0


def test_sudoku_partial_credit_is_d1s_share_of_correctly_filled_blanks():
    blanks = [i for i, c in enumerate(PUZZLE_4) if c == "0"]
    assert len(blanks) == 6
    wrong_two = list(SOLUTION_4)
    for i in blanks[:2]:
        wrong_two[i] = "9"
    wrong_two = "".join(wrong_two)
    assert verify_sudoku(wrong_two, PUZZLE_4) == 0.0
    assert verify_sudoku(wrong_two, PUZZLE_4, partial_credit=True) == pytest.approx(4 / 6)
    assert verify_sudoku(wrong_two, PUZZLE_4, SOLUTION_4, partial_credit=True) == pytest.approx(4 / 6)
    assert verify_sudoku(f"<answer>{SOLUTION_4[:9]}</answer>", PUZZLE_4, partial_credit=True) == \
        pytest.approx(sum(i < 9 for i in blanks) / 6)  # padded with 0 like d1
    assert verify_sudoku("", PUZZLE_4, partial_credit=True) == 0.0


def test_a_bad_puzzle_is_a_configuration_error():
    with pytest.raises(ValueError, match="16 .* or 81"):
        verify_sudoku(SOLUTION_4, "123")
    with pytest.raises(ValueError, match="digits 0-4"):
        verify_sudoku(SOLUTION_4, "5" * 16)


# ---------------------------------------------------------------------------------------- never raise
HOSTILE = [
    "", " ", "\x00\x01\x02", "\\boxed{", "\\boxed{}}}}", "}" * 1000, "{" * 5000, "\\boxed" * 10_000,
    "<answer>", "</answer><answer>", "((((((" * 1000, "9" * 100_000, "1e999999", "\\frac{1}{0}",
    "\\boxed{\\frac{1}{0}}", "\\boxed{\\infty}", "\\boxed{" + "\\sqrt{" * 300 + "}" * 300 + "}",
    "####", "#### ####", "the answer is", "answer: $", "answer: $$", "\\boxed{$}", "ÿ\ud800 surrogate",
    "<answer>1" + "+1" * 10_000 + "</answer>", "<answer>" + "(" * 500 + "1" + ")" * 500 + "</answer>",
    "<answer>__import__('os')</answer>", "\\boxed{x^{x^{x^{x}}}}", "²³", "٣+٤", "1/0", "0/0",
    "answer is 1/0", "-" * 1000 + "5", "\\boxed{10^{-10^{10}}}",
]


def test_verifiers_never_raise_on_hostile_text():
    math_row = TaskRow("q", "18", {})
    cd_row = TaskRow("q", "8*3", {"numbers": [8, 3], "target": 24})
    sd_row = TaskRow("q", SOLUTION_4, {"puzzle": PUZZLE_4})
    for text in HOSTILE + [None, 12, b"bytes", ["list"]]:
        for score in (verify_math(text, "18", timeout_s=1), verify_countdown(text, [8, 3], 24),
                      verify_sudoku(text, PUZZLE_4), verify_sudoku(text, PUZZLE_4, partial_credit=True),
                      verify_answer("math", text, math_row), verify_answer("countdown", text, cd_row),
                      verify_answer("sudoku", text, sd_row, partial_credit=True)):
            assert 0.0 <= score <= 1.0, text
        assert extract_final_answer(text) is None or isinstance(extract_final_answer(text), str)


# -------------------------------------------------------------------------------------------- dispatch
def test_verify_answer_takes_the_gold_from_the_row():
    assert verify_answer("math", "\\boxed{\\frac12}", TaskRow("q", "0.5", {})) == 1.0
    assert verify_answer("countdown", "<answer>8*3</answer>", TaskRow("q", "x", {"nums": [3, 8], "target": 24})) == 1.0
    row = TaskRow("q", SOLUTION_4, {"puzzle": PUZZLE_4})
    assert verify_answer("sudoku", SOLUTION_4, row) == 1.0
    assert verify_answer("sudoku", SOLUTION_4[:4] + "0" * 12, row, partial_credit=True) == pytest.approx(
        sum(1 for i, c in enumerate(PUZZLE_4) if c == "0" and i < 4) / 6)


def test_a_row_without_the_fields_its_kind_needs_is_a_configuration_error():
    with pytest.raises(ValueError, match="countdown task row needs the field 'numbers'"):
        verify_answer("countdown", "<answer>8*3</answer>", TaskRow("q", "8*3", {"target": 24}))
    with pytest.raises(ValueError, match="countdown task row needs the field 'target'"):
        verify_answer("countdown", "<answer>8*3</answer>", TaskRow("q", "8*3", {"numbers": [8, 3]}))
    with pytest.raises(ValueError, match="sudoku task row needs the field 'puzzle'"):
        verify_answer("sudoku", SOLUTION_4, TaskRow("q", SOLUTION_4, {}))
    with pytest.raises(ValueError, match="unknown verifier kind 'chess'"):
        verify_answer("chess", "e4", TaskRow("q", "e4", {}))  # type: ignore[arg-type]
