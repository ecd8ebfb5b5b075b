"""`steadyrl export` of the arith family, proved by round trip: a two-step run of each model family (masked
diffusion, autoregressive, block diffusion; LoRA over the tiny base and over a named base) is exported, loaded back
with the library a user would (transformers' `from_pretrained`, peft's `PeftModel.from_pretrained` over the base),
wrapped as steadyrl's policy wraps its network, and sampled with steadyrl's own samplers from the same seed: the
same tokens as the run's own checkpoint policy, and the same log-probabilities, bitwise where the computation is
the same (a whole network; adapters over their base) and within a stated tolerance where it is not (adapters merged
into the weights)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from steadyrl.rollout.policy import LanguageModelPolicy
from steadyrl.services.config import CONFIG_DIR, load_config
from steadyrl.services.driver.evaluate import checkpoint_policy
from steadyrl.services.driver.export import ExportError, export_run
from steadyrl.services.testbeds import build_testbed
from tests.helpers import train_local

ROOT = Path(__file__).resolve().parents[1]
# two steps of 4 problems x 4 completions, evaluated at steps 0 and 2 on 8 held-out problems, checkpointed at 2
SHORT = ["run.steps=2", "run.checkpoint_every=2", "run.eval_every=2", "testbed.eval_problems=8",
         "testbed.prompts_per_step=4", "sampler.group_size=4", "learner.micro_batch_size=16",
         "learner.optim_batch_size=16"]
#: merged LoRA (W + s B A as one float32 matrix) against adapters beside the base (W x + s B A x): the log-probs of
#: the same tokens differ by float32 rounding only (measured worst: see the merged test; the repo's float32 engine
#: tolerance, tests/vllm_backend)
MERGED_TOLERANCE = 1e-4
#: weights in from_pretrained's memory map (8-byte aligned) against aligned ones (see the block-diffusion test)
UNALIGNED_TOLERANCE = 1e-6
SEED = 11


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two-step runs, trained on first use: {name: run folder}."""
    done: dict[str, Path] = {}

    def run(name: str, preset: str, *overrides: str) -> Path:
        if name not in done:
            result, _ = train_local(CONFIG_DIR / preset, tmp_path_factory.mktemp(name) / "run",
                                    [*SHORT, *overrides])
            assert result.steps_done == 2
            done[name] = result.run_dir
        return done[name]
    return run


def checkpoint(run_dir: Path):
    """(the run's testbed, its policy at the exported step) as steadyrl builds them."""
    testbed = build_testbed(load_config(run_dir / "config.yaml"))
    return testbed, checkpoint_policy(testbed, run_dir / "checkpoints" / "step_2")


def front_matter(out: Path) -> dict:
    """The model card's YAML front matter."""
    text = (out / "README.md").read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def round_trip(testbed, policy, loaded, atol: float = 0.0) -> float:
    """Sample the run's held-out prompts with steadyrl's training and evaluation samplers from one seed, with the run's
    policy and with the loaded export: the same tokens; the stored log-probs, and the recomputed per-token log-probs
    and entropies (of the whole predicted distribution), equal within `atol` (0: bitwise). Returns the worst
    difference."""
    prompts, worst = testbed.eval_prompts(), 0.0
    for sampler in (testbed.build_sampler(), testbed.eval_sampler()):
        ours = testbed.sample(sampler, policy, prompts, 2, torch.Generator().manual_seed(SEED))
        theirs = testbed.sample(sampler, loaded, prompts, 2, torch.Generator().manual_seed(SEED))
        assert torch.equal(ours.samples, theirs.samples)
        pairs = [(ours.old_logp, theirs.old_logp)]
        with torch.no_grad():
            for t in range(ours.old_logp.shape[1]):
                run_lp, export_lp = (sampler.log_prob(model, ours, t, entropy=True) for model in (policy, loaded))
                pairs += [(run_lp.token_logp, export_lp.token_logp), (run_lp.entropy, export_lp.entropy)]
        for a, b in pairs:
            torch.testing.assert_close(b, a, rtol=0, atol=atol, equal_nan=True)
            worst = max(worst, float((a - b).abs().nan_to_num().max()))
    return worst


def aligned(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with each weight in a fresh allocation (the same values): `from_pretrained` leaves them in the
    safetensors file's memory map, 8-byte aligned, where a DiffusionGemma's per-expert matmuls round differently
    (see the block-diffusion test)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def check_tokenizer(testbed, out: Path) -> None:
    """The exported tokenizer encodes the run's prompts to the run's ids and decodes completions as the run does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=testbed.settings.trust_remote_code)
    codec = testbed.codec
    problems = testbed.task.problems(testbed.settings.eval_seed, range(8))
    assert [tok.encode(p.prompt, add_special_tokens=False) for p in problems] == \
        [codec.encode(p.prompt) for p in problems]
    answers = testbed.task.encode_completions(problems, codec)
    assert [tok.decode(row, skip_special_tokens=True) for row in answers.tolist()] == \
        [codec.decode(row) for row in answers.tolist()]
    assert (tok.eos_token_id, tok.pad_token_id) == (codec.eos_id, codec.pad_id)
    # a class name transformers 4 loads too (transformers 5 would write its own "TokenizersBackend")
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] != "TokenizersBackend"


def check_card(run_dir: Path, out: Path, library: str, base_model: str | None, *tags: str) -> None:
    """The model card's front matter parses as YAML, names the library, the base, the objective and the testbed."""
    cfg = load_config(run_dir / "config.yaml")
    front = front_matter(out)
    assert front["library_name"] == library and front.get("base_model") == base_model
    assert {"steadyrl", cfg.objective.name, cfg.testbed.name, *tags} <= set(front["tags"])


def test_a_masked_diffusion_export_loads_as_a_transformers_masked_lm_and_samples_the_runs_tokens_bitwise(
        runs, tmp_path):
    from transformers import AutoModelForMaskedLM, GenerationConfig

    run_dir = runs("arith", "arith-grpo.yaml")
    out, info = export_run(run_dir, tmp_path / "export")
    testbed, policy = checkpoint(run_dir)
    loaded = AutoModelForMaskedLM.from_pretrained(out)
    assert round_trip(testbed, policy, loaded) == 0.0
    check_tokenizer(testbed, out)
    gen, s = GenerationConfig.from_pretrained(out), testbed.cfg.sampler
    assert (gen.steps, gen.gen_length, gen.block_length, gen.remasking, gen.mask_token_id) == \
        (s.num_steps, s.gen_length, s.gen_length, s.remasking, testbed.mask_token_id)
    check_card(run_dir, out, "transformers", None, "masked-diffusion")
    assert info.library == "transformers" and "AutoModelForMaskedLM" in info.load


def test_an_autoregressive_export_by_the_cli_loads_as_a_causal_lm_whose_generate_gives_the_runs_greedy_tokens(
        runs, tmp_path):
    """`steadyrl export RUN OUT` in a subprocess; transformers' own `generate` under the export's
    generation_config.json decodes greedily to the tokens of steadyrl's evaluation sampler."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    run_dir = runs("arith_ar", "arith-ar-grpo.yaml")
    out = tmp_path / "export"
    done = subprocess.run([sys.executable, "-m", "steadyrl.services.driver.cli", "export", str(run_dir), str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert str(out) in done.stdout and "AutoModelForCausalLM.from_pretrained" in done.stdout
    testbed, policy = checkpoint(run_dir)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert round_trip(testbed, policy, loaded) == 0.0
    check_tokenizer(testbed, out)
    gen, s = GenerationConfig.from_pretrained(out), testbed.cfg.sampler
    assert (gen.max_new_tokens, gen.eos_token_id, gen.pad_token_id, gen.temperature, gen.do_sample) == \
        (s.gen_length, testbed.codec.eos_id, testbed.codec.pad_id, s.temperature, True)
    prompts = testbed.eval_prompts()
    greedy = testbed.sample(testbed.eval_sampler(), policy, prompts, 1, torch.Generator().manual_seed(0)).samples
    with torch.no_grad():
        generated = loaded.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False)
    completion = generated[:, prompts.shape[1]:]
    padded = torch.full_like(greedy, testbed.codec.pad_id)
    padded[:, :completion.shape[1]] = completion
    assert torch.equal(padded, greedy)
    check_card(run_dir, out, "transformers", None, "text-generation")
    assert "steadyrl export" in (out / "README.md").read_text()


def test_a_block_diffusion_export_loads_as_diffusiongemma_and_samples_the_runs_tokens_bitwise(runs, tmp_path):
    """Bitwise once the weights sit in memory the CPU allocator aligns: `from_pretrained` leaves them in the
    safetensors file's memory map, 8-byte aligned, and the experts' per-expert matmuls then round differently (the
    same tokens and per-token log-probs; entropies within UNALIGNED_TOLERANCE, measured worst 1.9e-08 on
    2026-12-05). The masked and causal LMs' exports compute bitwise as loaded."""
    from transformers import AutoModelForImageTextToText

    run_dir = runs("arith_bd", "arith-bd-grpo.yaml")
    out, _ = export_run(run_dir, tmp_path / "export")
    testbed, policy = checkpoint(run_dir)
    loaded = AutoModelForImageTextToText.from_pretrained(out)
    assert type(loaded).__name__ == "DiffusionGemmaForBlockDiffusion"
    print(f"\nblock diffusion as loaded: worst difference {round_trip(testbed, policy, loaded, UNALIGNED_TOLERANCE):.1e}")
    assert round_trip(testbed, policy, aligned(loaded)) == 0.0
    check_tokenizer(testbed, out)
    gen, s = loaded.generation_config, testbed.cfg.sampler  # what from_pretrained read from generation_config.json
    assert type(gen).__name__ == "DiffusionGemmaGenerationConfig" and loaded.config.canvas_length == s.block
    assert (gen.max_denoising_steps, gen.t_min, gen.t_max, gen.sampler_config.entropy_bound, gen.max_new_tokens) == \
        (s.num_steps, s.t_min, s.t_max, s.entropy_bound, s.gen_length)
    check_card(run_dir, out, "transformers", None, "block-diffusion")


#: LoRA runs: (preset, the Auto class its export loads with)
LORA = {"arith": ("arith-grpo.yaml", "AutoModelForMaskedLM"), "arith_ar": ("arith-ar-grpo.yaml", "AutoModelForCausalLM"),
        "arith_bd": ("arith-bd-grpo.yaml", "AutoModelForImageTextToText")}


@pytest.mark.parametrize("family", LORA)
def test_lora_adapters_load_with_peft_over_the_exported_tiny_base_and_sample_the_runs_tokens_bitwise(
        family, runs, tmp_path):
    """Adapters alone (the default with testbed.lora): peft's PeftModel over base/ (a causal LM's as
    PeftModelForCausalLM, the others as a plain PeftModel), wrapped as steadyrl wraps its network
    (`LanguageModelPolicy`), computes exactly as the run's policy; the adapters moved off B = 0."""
    import transformers
    from peft import PeftModel

    preset, auto = LORA[family]
    run_dir = runs(f"{family}_lora", preset, "testbed.lora.rank=4")
    out, info = export_run(run_dir, tmp_path / "export")
    assert {"adapter_config.json", "adapter_model.safetensors", "base"} <= set(os.listdir(out))
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
    testbed, policy = checkpoint(run_dir)
    model = PeftModel.from_pretrained(getattr(transformers, auto).from_pretrained(out / "base"), out)
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    assert not any("vision" in n for n, _ in model.named_parameters() if "lora_" in n)  # DiffusionGemma's: text only
    assert round_trip(testbed, policy, LanguageModelPolicy(aligned(model)).eval()) == 0.0
    check_tokenizer(testbed, out)
    check_card(run_dir, out, "peft", None, "lora")
    assert info.library == "peft" and "PeftModel.from_pretrained" in info.load and auto in info.load


#: LoRA runs whose adapters merge into one set of weights (a DiffusionGemma's decoder shares its encoder's
#: layer weights, each use with its own adapters: see the refusal test below)
MERGEABLE = [family for family in LORA if family != "arith_bd"]


@pytest.mark.parametrize("family", MERGEABLE)
def test_merged_lora_samples_the_runs_tokens_with_log_probs_within_float32_rounding(family, runs, tmp_path):
    """--merge fuses the adapters into a plain transformers model (no peft module left). Measured worst per-token
    difference (per-token log-probs, the sequences' sums, the entropies) against the run's adapters-beside-the-base
    policy: 1.0e-05 (arith), 7.9e-06 (arith_ar) (2026-12-05), under MERGED_TOLERANCE; the sampled tokens are the
    same."""
    import transformers

    preset, auto = LORA[family]
    run_dir = runs(f"{family}_lora", preset, "testbed.lora.rank=4")
    out, info = export_run(run_dir, tmp_path / "merged", merge=True)
    assert not (out / "adapter_config.json").exists()
    testbed, policy = checkpoint(run_dir)
    loaded = getattr(transformers, auto).from_pretrained(out)
    assert not any("lora" in k for k in loaded.state_dict())
    worst = round_trip(testbed, policy, loaded, atol=MERGED_TOLERANCE)
    print(f"\n{family}: merged LoRA vs adapters: worst log-prob difference {worst:.2e}")
    check_card(run_dir, out, "transformers", None, "lora")
    assert info.library == "transformers"


def test_merging_adapters_on_shared_weights_is_refused_naming_them_with_nothing_written(runs, tmp_path):
    """A DiffusionGemma's decoder layers reuse its encoder's weights, and LoRA adapts each use apart: W + B_enc A_enc
    for the encoder, W + B_dec A_dec for the decoder. One merged W cannot be both (merged anyway, the recompute
    was 0.02 off in log-prob), so --merge is refused naming the two layers; the adapters export as trained."""
    run_dir = runs("arith_bd_lora", "arith-bd-grpo.yaml", "testbed.lora.rank=4")
    out = tmp_path / "merged"
    with pytest.raises(ExportError, match=r"--merge: .*encoder.* and .*decoder.* share one base weight.*without --merge"):
        export_run(run_dir, out, merge=True)
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def named_base(tmp_path_factory):
    """A causal LM by directory (testbed.pretrained): the arith_ar preset's pre-trained tiny Llama, saved by
    save_pretrained with a character tokenizer of the same ids, as a hub model is laid out."""
    from safetensors.torch import load_file

    from steadyrl.rollout.arith import EOS, PAD, TOKENIZER
    from steadyrl.rollout.hf_export import char_tokenizer

    tb = build_testbed(load_config(CONFIG_DIR / "arith-ar-grpo.yaml"))
    d = tmp_path_factory.mktemp("named-llama")
    tb.family.tiny_network(tb, load_file(str(tb.base_weights(progress=False)))).save_pretrained(d)
    char_tokenizer(TOKENIZER.vocab, PAD, EOS).save_pretrained(d)
    return d


def test_adapters_over_a_named_base_name_it_and_load_with_peft_over_that_base(runs, named_base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = runs("named_lora", "arith-ar-grpo.yaml", f"testbed.pretrained={named_base}", "testbed.lora.rank=4")
    out, info = export_run(run_dir, tmp_path / "export")
    assert "base" not in os.listdir(out)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(named_base)
    testbed, policy = checkpoint(run_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(named_base), out)
    assert round_trip(testbed, policy, LanguageModelPolicy(model).eval()) == 0.0
    check_tokenizer(testbed, out)
    check_card(run_dir, out, "peft", str(named_base), "lora")
    assert info.base_model == str(named_base) and str(named_base) in info.load


def test_an_export_whose_base_cannot_be_had_offline_is_refused_naming_it_before_anything_is_written(
        runs, named_base, tmp_path):
    """The run's config names a hub id that is not in the cache (HF_HUB_OFFLINE=1): a merge (or any export, since
    the checkpoint's policy is built on it) fails naming the setting and the id, and leaves nothing behind."""
    import shutil

    run_dir = shutil.copytree(runs("named_lora", "arith-ar-grpo.yaml", f"testbed.pretrained={named_base}",
                                   "testbed.lora.rank=4"), tmp_path / "run")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["testbed"]["pretrained"] = "steadyrl-tests/no-such-model"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "exports" / "merged"
    with pytest.raises(ExportError, match=r"testbed\.pretrained='steadyrl-tests/no-such-model'.*not in the local"):
        export_run(run_dir, out, merge=True)
    assert not (tmp_path / "exports").exists()


def test_a_remote_code_masked_lm_exports_with_its_modelling_code_and_loads_with_trust_remote_code(runs, tmp_path):
    """A LLaDA-style model by directory (its own modelling code, `auto_map`): the export carries the code, and
    `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` (LLaDA's auto_map) samples bitwise as the
    run's policy."""
    from transformers import AutoModelForCausalLM

    from tests.assets.tiny_llada import write_char_tokenizer, write_tiny_llada

    base = tmp_path / "tiny-llada"
    write_tiny_llada(base, vocab_size=24, mask_token_id=23)
    write_char_tokenizer(base)
    run_dir = runs("llada", "arith-grpo.yaml", f"testbed.pretrained={base}", "testbed.trust_remote_code=true")
    out, info = export_run(run_dir, tmp_path / "export")
    assert {"modeling_tiny_llada.py", "configuration_tiny_llada.py"} <= set(os.listdir(out))
    testbed, policy = checkpoint(run_dir)
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert round_trip(testbed, policy, loaded) == 0.0
    check_tokenizer(testbed, out)
    check_card(run_dir, out, "transformers", str(base), "masked-diffusion")
    assert "trust_remote_code=True" in info.load
