"""Prompt sets for text-to-image training: parsing, shipped sets, train/eval splits, the prompts of a step."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from steadyrl.rollout.prompts import (
    PromptsConfig,
    PromptSet,
    build_splits,
    load_prompt_set,
    shipped_prompt_sets,
    step_indices,
    step_prompts,
)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------- parsing
def test_txt_skips_comments_and_blank_lines_strips_whitespace_and_keeps_duplicates(tmp_path):
    path = write(tmp_path, "p.txt", "# a comment\n  cat  \n\n\tdog\n   \n# another\ncat\r\na red ball\n")
    ps = load_prompt_set(path)
    assert ps.prompts == ("cat", "dog", "cat", "a red ball")
    assert ps.metadata == ({}, {}, {}, {}) and ps.name == "p" and len(ps) == 4


def test_jsonl_keeps_every_other_key_as_metadata_and_skips_blank_lines(tmp_path):
    rows = [{"prompt": " three red apples ", "tag": "counting", "count": 3, "color": "red"}, {"prompt": "a cat"}]
    path = write(tmp_path, "s.jsonl", json.dumps(rows[0]) + "\n\n   \n" + json.dumps(rows[1]) + "\n")
    ps = load_prompt_set(str(path))
    assert ps.prompts == ("three red apples", "a cat")
    assert ps.metadata == ({"tag": "counting", "count": 3, "color": "red"}, {})


@pytest.mark.parametrize("line, words", [
    ('{"prompt": "a cat",', ["malformed JSON"]),
    ('["a cat"]', ["JSON object", "list"]),
    ('{"text": "a cat"}', ['"prompt"', "missing"]),
    ('{"prompt": "   "}', ['"prompt"', "empty"]),
    ('{"prompt": 3}', ['"prompt"', "string"]),
])
def test_a_bad_jsonl_line_is_refused_naming_the_file_line_number_and_field(tmp_path, line, words):
    path = write(tmp_path, "bad.jsonl", '{"prompt": "a dog"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as err:
        load_prompt_set(path)
    msg = str(err.value)
    assert "bad.jsonl" in msg and "line 3" in msg
    assert all(w in msg for w in words), msg


def test_unknown_extension_unknown_name_empty_and_missing_files_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match=r"extension '\.csv'"):
        load_prompt_set(write(tmp_path, "p.csv", "cat\n"))
    with pytest.raises(ValueError) as err:
        load_prompt_set("aminals")
    assert "aminals" in str(err.value) and all(name in str(err.value) for name in shipped_prompt_sets())
    with pytest.raises(ValueError, match="no prompts"):
        load_prompt_set(write(tmp_path, "empty.txt", "# only a comment\n\n"))
    with pytest.raises(ValueError, match="no prompts"):
        load_prompt_set(write(tmp_path, "empty.jsonl", "\n \n"))
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_prompt_set(tmp_path / "nope.txt")


def test_shipped_sets_all_load_nonempty_by_name():
    shipped = shipped_prompt_sets()
    assert {"animals", "objects", "scenes", "tiny"} <= set(shipped)
    for name, path in shipped.items():
        ps = load_prompt_set(name)
        assert len(ps) > 0 and ps.name == name and ps == load_prompt_set(path).subset(range(len(ps)), name)
        assert all(p and p == p.strip() for p in ps.prompts)
    assert len(load_prompt_set("tiny")) == 6
    scenes = load_prompt_set("scenes")
    assert {m["tag"] for m in scenes.metadata} == {"color", "counting", "position", "style"}
    assert all(isinstance(m["count"], int) for m in scenes.metadata if m["tag"] == "counting")


def test_subset_takes_prompts_and_metadata_at_the_indices():
    ps = PromptSet(("a", "b", "c"), ({"i": 0}, {"i": 1}, {"i": 2}), "x")
    sub = ps.subset(torch.tensor([2, 0]))
    assert sub.prompts == ("c", "a") and sub.metadata == ({"i": 2}, {"i": 0}) and sub.name == "x"
    with pytest.raises(IndexError):
        ps.subset([3])
    with pytest.raises(ValueError):
        PromptSet(("a", "b"), ({},), "x")


# ------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs, field", [
    ({"eval_fraction": 1.0}, "eval_fraction"), ({"eval_fraction": 0.0}, "eval_fraction"),
    ({"prompts_per_step": 0}, "prompts_per_step"), ({"eval_prompts": 0}, "eval_prompts"),
    ({"train": "aminals"}, "train"), ({"eval": "data/p.csv"}, "eval"), ({"split_seed": -1}, "split_seed"),
    ({"shuffle": True}, "shuffle"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as err:
        PromptsConfig(**kwargs)
    assert field in str(err.value)


def test_config_accepts_paths_it_cannot_check_yet():
    assert PromptsConfig(train="/data/my_prompts.jsonl", eval="eval.txt").eval == "eval.txt"


# ------------------------------------------------------------------------------------------- splits
def test_split_of_one_file_is_disjoint_by_index_covers_the_set_and_keeps_file_order():
    cfg = PromptsConfig(train="animals", eval_fraction=0.2)
    s = build_splits(cfg)
    n = len(load_prompt_set("animals"))
    assert set(s.train_indices).isdisjoint(s.eval_indices)
    assert sorted(s.train_indices + s.eval_indices) == list(range(n))
    assert len(s.eval) == round(0.2 * n) and len(s.train) == n - len(s.eval)
    assert list(s.train_indices) == sorted(s.train_indices) and list(s.eval_indices) == sorted(s.eval_indices)
    full = load_prompt_set("animals")
    assert s.train.prompts == tuple(full.prompts[i] for i in s.train_indices)


def test_split_is_deterministic_given_the_seed_and_differs_for_another():
    a, b = build_splits(PromptsConfig(split_seed=3)), build_splits(PromptsConfig(split_seed=3))
    assert a == b
    assert build_splits(PromptsConfig(split_seed=4)).eval_indices != a.eval_indices
    assert build_splits(PromptsConfig(split_seed=3, train_seed=9)) == a  # the order of training is separate


def test_a_separate_eval_set_keeps_all_of_train_and_the_cap_is_a_seeded_sample(tmp_path):
    s = build_splits(PromptsConfig(train="tiny", eval="scenes", eval_prompts=5))
    assert len(s.train) == 6 and s.train_indices == tuple(range(6))
    assert len(s.eval) == 5 and all(m for m in s.eval.metadata)  # metadata travels with the prompts
    assert s == build_splits(PromptsConfig(train="tiny", eval="scenes", eval_prompts=5))
    capped = build_splits(PromptsConfig(train="animals", eval_prompts=2))
    assert len(capped.eval) == 2 and set(capped.eval_indices) <= set(build_splits(PromptsConfig()).eval_indices)


def test_a_split_that_leaves_a_side_empty_names_eval_fraction(tmp_path):
    path = write(tmp_path, "three.txt", "a\nb\nc\n")
    with pytest.raises(ValueError, match=r"prompts\.eval_fraction"):
        build_splits(PromptsConfig(train=str(path), eval_fraction=0.1))
    with pytest.raises(ValueError, match=r"prompts\.eval_fraction"):
        build_splits(PromptsConfig(train=str(path), eval_fraction=0.9))


# ------------------------------------------------------------------------------------- step prompts
@pytest.mark.parametrize("per_step, n_workers", [(8, 1), (8, 3), (7, 7), (5, 2)])
def test_worker_shares_are_disjoint_cover_the_step_and_group_ids_do_not_collide(per_step, n_workers):
    cfg = PromptsConfig(prompts_per_step=per_step, train_seed=1)
    for step in (0, 5):
        shares = [step_prompts(cfg, 36, step, w, n_workers) for w in range(n_workers)]
        idx = torch.cat([s[0] for s in shares])
        assert all(s[0].dtype == torch.long for s in shares)
        assert idx.tolist() == step_indices(cfg, 36, step).tolist() and len(set(idx.tolist())) == per_step
        groups = [g for ix, first in shares for g in range(first, first + len(ix))]
        assert groups == list(range(per_step))  # step-local group ids 0..P-1, one per prompt
        sizes = [len(a) for a in np.array_split(np.arange(per_step), n_workers)]
        assert [len(s[0]) for s in shares] == sizes


@pytest.mark.parametrize("n, per_step", [(36, 8), (10, 3), (5, 4), (7, 4), (9, 5), (8, 8), (12, 6), (11, 2)])
def test_every_train_prompt_is_used_once_before_any_repeats_and_each_step_is_distinct(n, per_step):
    cfg = PromptsConfig(prompts_per_step=per_step, train_seed=2)
    steps = [step_indices(cfg, n, s) for s in range(3 * n)]  # 3 * per_step passes over the split
    assert all(len(set(s.tolist())) == per_step for s in steps)
    stream = np.concatenate(steps)
    for e in range(len(stream) // n):
        assert sorted(stream[e * n:(e + 1) * n].tolist()) == list(range(n)), f"pass {e}"


def test_step_prompts_are_deterministic_in_seed_and_step_and_reshuffled_per_pass():
    cfg = PromptsConfig(prompts_per_step=4, train_seed=7)
    first = [step_indices(cfg, 36, s).tolist() for s in range(20)]
    assert first == [step_indices(cfg, 36, s).tolist() for s in range(20)]
    assert [step_indices(cfg, 36, s).tolist() for s in reversed(range(20))] == first[::-1]  # random access
    other = [step_indices(cfg.model_copy(update={"train_seed": 8}), 36, s).tolist() for s in range(20)]
    assert other != first
    assert np.concatenate(first[:9]).tolist() != np.concatenate(first[9:18]).tolist()  # each pass a new shuffle


def test_step_prompt_errors_name_the_field():
    cfg = PromptsConfig(prompts_per_step=4)
    with pytest.raises(ValueError, match=r"ray\.rollout_workers"):
        step_prompts(cfg, 36, 0, 0, 5)
    with pytest.raises(ValueError, match=r"prompts\.prompts_per_step"):
        step_prompts(cfg, 3, 0, 0, 1)
    with pytest.raises(ValueError, match="worker 2"):
        step_prompts(cfg, 36, 0, 2, 2)
