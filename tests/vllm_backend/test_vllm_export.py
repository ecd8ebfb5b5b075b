"""`steadyrl export` of an autoregressive run, served by vLLM as a user would load it: `vllm.LLM(path)` reads the
folder's config.json, weights, tokenizer and generation_config.json, and decodes text prompts greedily to the tokens
of steadyrl's own policy at that checkpoint (float32, eager, as tests/vllm_backend/test_vllm_engine.py runs it)."""
from __future__ import annotations

import os

import pytest

from steadyrl.services.config import CONFIG_DIR, load_config
from steadyrl.services.driver.evaluate import checkpoint_policy, seeded_samples
from steadyrl.services.driver.export import export_run
from steadyrl.services.testbeds import build_testbed
from tests.helpers import train_local

SHORT = ["run.steps=2", "run.checkpoint_every=2", "run.eval_every=2", "testbed.eval_problems=8",
         "testbed.prompts_per_step=4", "sampler.group_size=4", "learner.micro_batch_size=16",
         "learner.optim_batch_size=16"]


VARIANTS = {"full": ([], False), "lora-merged": (["testbed.lora.rank=4"], True)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Both runs trained, exported and sampled by steadyrl before any engine starts in this process: vLLM's
    in-process engine leaves torch.distributed groups behind that a later DeepSpeed engine here cannot use."""
    made = {}
    for name, (trained, merge) in VARIANTS.items():
        tmp = tmp_path_factory.mktemp(name)
        result, _ = train_local(CONFIG_DIR / "arith-ar-grpo.yaml", tmp / "run", [*SHORT, *trained])
        out, _ = export_run(result.run_dir, tmp / "export", merge=merge)
        testbed = build_testbed(load_config(result.run_dir / "config.yaml"))
        policy = checkpoint_policy(testbed, result.run_dir / "checkpoints" / "step_2")
        problems = testbed.task.problems(testbed.settings.eval_seed, range(16))
        ours = seeded_samples(testbed, policy, testbed.task.encode_prompts(problems, testbed.codec), 1,
                              seed=0).samples  # greedy
        made[name] = out, testbed, problems, ours
    return made


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_vllm_loads_the_whole_model_export_and_decodes_greedily_as_the_runs_policy(variant, exported):
    """Every weight trained, or LoRA merged into the base (`--merge`): a plain LlamaForCausalLM folder either way."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    out, testbed, problems, ours = exported[variant]
    codec, gen_length = testbed.codec, testbed.cfg.sampler.gen_length
    llm = LLM(str(out), dtype="float32", enforce_eager=True, max_model_len=testbed.settings.model.max_positions,
              seed=0)
    assert llm.get_default_sampling_params().max_tokens == gen_length  # generation_config.json's max_new_tokens
    outputs = llm.generate([p.prompt for p in problems], SamplingParams(temperature=0.0, max_tokens=gen_length))
    for problem, output, row in zip(problems, outputs, ours.tolist()):
        expected = row[:row.index(codec.eos_id) + 1] if codec.eos_id in row else row
        assert list(output.prompt_token_ids) == codec.encode(problem.prompt)  # the exported tokenizer's ids
        assert list(output.outputs[0].token_ids) == expected, problem.prompt
        assert output.outputs[0].text == codec.decode(row)
