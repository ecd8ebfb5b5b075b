"""An OpenAI-compatible chat endpoint as a judge (`kind: http`, `protocol: openai_chat`) against vLLM's own server
(`vllm serve` from this venv, on 127.0.0.1), serving a tiny random Llama with a character tokenizer and a chat
template. Checked against independent references: the log-probability score is p(1) / (p(1) + p(0)) of the
judge's next token as transformers computes it on the same weights and templated text; the reply score is the
pattern's number in the reply the server gives the same request; a model the server does not serve is an error
naming it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from steadyrl.reward.factory import build_reward_model
from steadyrl.reward.http_transport import RemoteScorerError
from steadyrl.rollout.causal_lm import CausalLMConfig, build_causal_lm, write_hf_checkpoint
from tests.helpers import free_port

CHARS = list(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+=?:.,-")
SPECIALS = ["<pad>", "<eos>", "<unk>"]
TEMPLATE = "Is {completion} the answer to {prompt}? Answer 1 or 0:"
ITEMS = [("07+45=", "52"), ("1+1=", "3"), ("12+30=", "42")]


def write_judge(directory: Path) -> Path:
    """A random LlamaForCausalLM over single characters, with a tokenizer whose chat template is the messages'
    text, saved as `vllm serve` and transformers load it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    torch.manual_seed(0)
    net = build_causal_lm(CausalLMConfig(max_positions=256), len(vocab), vocab["<pad>"], vocab["<eos>"])
    write_hf_checkpoint(net, directory)
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """(API base URL, model directory) of `vllm serve` on the tiny judge, stopped at the end."""
    model = write_judge(tmp_path_factory.mktemp("judge"))
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    log = open(model / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", "--max-model-len", "256", "--max-logprobs", "128",
                               "--enforce-eager"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 600
    while time.time() < deadline:
        assert server.poll() is None, (model / "server.log").read_text()[-3000:]
        try:
            if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(2)
    else:
        server.kill()
        pytest.fail("vllm serve did not come up in 600 s")
    yield url, model
    server.terminate()
    server.wait(timeout=60)
    log.close()


def spec(url: str, **judge) -> dict:
    return {"kind": "http", "name": "judge", "url": url, "protocol": "openai_chat", "text": {},
            "judge": {"model": "judge", "template": TEMPLATE, **judge}}


def test_the_logprob_score_is_the_judges_next_token_probability_of_1_over_1_or_0(judge):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, model_dir = judge
    reward = build_reward_model(spec(url, score="logprobs", answers={"1": 1.0, "0": 0.0},
                                     top_logprobs=len(CHARS) + len(SPECIALS)))
    scores, _ = reward.score_items([p for p, _ in ITEMS], [c for _, c in ITEMS])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    expected = []
    for prompt, completion in ITEMS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": TEMPLATE.format(
            prompt=prompt, completion=completion)}], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            p = lm(ids).logits[0, -1].double().softmax(-1)
        one, zero = p[tokenizer.convert_tokens_to_ids("1")], p[tokenizer.convert_tokens_to_ids("0")]
        expected.append(float(one / (one + zero)))
    assert torch.allclose(scores.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-4), (scores, expected)
    assert len(set(expected)) == len(expected)  # the items differ: the score follows the text judged


def test_the_reply_score_is_the_patterns_number_in_the_servers_reply(judge):
    url, _ = judge
    reward = build_reward_model(spec(url, score="reply", pattern=r"([0-9])", scale=0.5, unparsed=-1.0,
                                     max_tokens=12))
    scores, _ = reward.score_items([p for p, _ in ITEMS], [c for _, c in ITEMS])
    for (prompt, completion), score in zip(ITEMS, scores.tolist()):
        body = {"model": "judge", "temperature": 0.0, "max_tokens": 12, "messages": [
            {"role": "user", "content": [{"type": "text", "text": TEMPLATE.format(prompt=prompt,
                                                                                  completion=completion)}]}]}
        reply = httpx.post(f"{url}/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
        match = re.search(r"([0-9])", reply["content"] or "")
        assert score == (-1.0 if match is None else 0.5 * int(match.group(1))), (reply, score)


def test_a_model_the_server_does_not_serve_is_an_error_naming_it(judge):
    url, _ = judge
    bad = spec(url)
    bad["judge"]["model"] = "gpt-judge"
    with pytest.raises(RemoteScorerError, match=r"judge.model='gpt-judge' is not served at .*serves \['judge'\]"):
        build_reward_model(bad)
