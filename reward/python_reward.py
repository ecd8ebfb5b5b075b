"""A user's reward function by import path (`kind: python`): no registration, no change to steadyrl.

    function: my_rewards.brightness:score        a module on sys.path, and the attribute in it
    function: ./my_rewards.py:score              a file (made absolute when the config loads)

The attribute is a function, called as `fn(images, prompts, **settings)`, or a class, built once as
`cls(**settings)` and then called as `obj(images, prompts)`. For image testbeds:

    images   list of B uint8 arrays [H, W, C] (`images: pil`: PIL images), decoded from [-1, 1]
    prompts  list of B conditions: prompt strings (text_to_image) or class ids (digits)
    returns  B numbers, higher is better (a list, a numpy array or a tensor), or with `keys: [a, b]` a dict of
             named scores {"a": B numbers, "b": B numbers}: each becomes a column `<name>.<key>` (the columns of
             one batch share one call where they share a process: the local runtime, colocated Serve replicas)

With `metadata: true` (text-to-image) the call is `fn(images, prompts, metadata)`: each prompt's metadata, the keys
besides `prompt` of a .jsonl prompt set ({} where none), as GenEval-style rewards read what a prompt asks for.

For language-model testbeds (the arith family) the testbed fills in `text` (its tokenizer and task) and the call
is `fn(completions, prompts, answers, **settings)`: B completion strings (up to the first EOS), their prompt strings
and the prompts' reference answers (a task file's gold answer, an addition's sum; None where there is none).

`groupwise: true` calls it once per prompt group, with that group's images and prompts (in batch order), so it
can score a sample against its group (a rank, a group-relative score); every other reward scores per sample.

A function that raises fails the step with its own message and the path (a user's bug is not retried); a
return of the wrong length or with non-numbers is an error naming the reward. A non-finite score (NaN, inf) marks
a sample the function could not score: it is kept as NaN, and a sample whose training reward is NaN is skipped and
counted (`reward/nonfinite_skipped`), never trained on (`reward.base.UserRewardModel`).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import pickle
import sys
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import Tensor

from steadyrl.reward.base import UserRewardModel
from steadyrl.reward.verifiers import VerifierReward, VerifierSpec
from steadyrl.rollout.settings_base import StrictModel


class RewardFunctionError(RuntimeError):
    """A user's reward function raised, or returned something that is not B numbers."""


class PythonRewardSpec(StrictModel):
    """A reward function or class by import path (module docstring has the signature)."""

    kind: Literal["python"] = "python"
    name: str = Field(description="the reward's name: its column in the ensemble and in the metrics")
    function: str = Field(description="`module.path:attribute` or `path/to/file.py:attribute`: a function "
                          "called per batch, or a class built once with `settings` and then called per batch")
    settings: dict[str, Any] = Field(default_factory=dict, description="keyword arguments: the class's "
                                     "constructor's, or passed to the function on every call")
    images: Literal["uint8", "pil"] = Field("uint8", description="how images reach the function: uint8 arrays "
                                            "[H, W, C] or PIL images")
    groupwise: bool = Field(False, description="call the function once per prompt group (its samples together, "
                            "e.g. for rank-based rewards), not once per batch of unrelated samples")
    keys: list[str] | None = Field(None, min_length=1, description="the function returns a dict of named scores "
                                   "(each a list of B numbers): each key becomes its own column `<name>.<key>`, "
                                   "trained on, weighted or watched like any model's")
    metadata: bool = Field(False, description="text-to-image: also pass each prompt's metadata (the keys besides "
                           "`prompt` of a .jsonl prompt set; {} where none), as a third argument: a GenEval-style "
                           "reward reads what the prompt asks for there")
    key: str | None = Field(None, description="filled in from `keys` (not a user setting): the one score this "
                            "column reads from the returned dict")
    text: VerifierSpec | None = Field(None, description="language-model testbeds fill this in (not a user "
                                      "setting): the tokenizer that decodes completions and the task whose reference "
                                      "answers the function gets")
    prompt_metadata: dict[str, dict[str, Any]] | None = Field(
        None, description="with `metadata`, the text-to-image testbed fills this in (not a user setting): each "
        "prompt's metadata by prompt text")

    @field_validator("function")
    @classmethod
    def _resolves(cls, v: str) -> str:
        """The path resolves now, when the config loads (a file path is made absolute, so every process finds
        it); a typo fails here, before anything starts."""
        v = absolute_path(v)
        resolve(v)
        return v


def absolute_path(function: str) -> str:
    """`file.py:attr` with the file made absolute; a module path unchanged."""
    target, _, attr = function.rpartition(":")
    if target.endswith(".py"):
        return f"{Path(target).expanduser().resolve()}:{attr}"
    return function


def resolve(function: str) -> Any:
    """The object `module.path:attr` or `file.py:attr` names; a ValueError naming what did not resolve."""
    target, sep, attr = function.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"function={function!r} must be 'module.path:attribute' or 'path/to/file.py:attribute'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"function={function!r}: no file {path}")
        name = f"steadyrl_user_reward_{abs(hash(str(path)))}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as err:
                raise ValueError(f"function={function!r}: importing {path} raised {type(err).__name__}: {err}") from err
            sys.modules[name] = module
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ValueError(f"function={function!r}: cannot import module {target!r} ({err}); is it installed or "
                             "on PYTHONPATH? A file can be named by its path: path/to/file.py:attribute") from err
    if not hasattr(module, attr):
        raise ValueError(f"function={function!r}: module {target!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise ValueError(f"function={function!r}: {attr!r} is a {type(obj).__name__}, not a function or class")
    return obj


def to_images(samples: Tensor, form: Literal["uint8", "pil"]) -> list[Any]:
    """[B, C, H, W] in [-1, 1] -> B uint8 arrays [H, W, C] (round((x + 1) * 127.5)), or PIL images of them."""
    arrays = ((samples.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    arrays = arrays.permute(0, 2, 3, 1).cpu().numpy()
    if form == "uint8":
        return list(arrays)
    from PIL import Image

    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in arrays]


def to_prompts(cond: Tensor | list[str]) -> list[Any]:
    """Prompt strings as they are; class ids as ints."""
    return cond.tolist() if isinstance(cond, Tensor) else list(cond)


def named_score_columns(specs: list[Any]) -> list[Any]:
    """Each function spec with `keys` as one spec per key (name `<name>.<key>`, reading `key`); others as they are."""
    out = []
    for s in specs:
        if isinstance(s, PythonRewardSpec) and s.keys is not None:
            out.extend(s.model_copy(update={"name": f"{s.name}.{k}", "key": k, "keys": None}) for k in s.keys)
        else:
            out.append(s)
    return out


class PythonReward(UserRewardModel):
    """The `RewardModel` over a user's function or class (module docstring)."""

    def __init__(self, spec: PythonRewardSpec, call: Callable[..., Any], text: VerifierReward | None = None):
        """`text`: for a language model, the decoder and reference answers (the verifier of the testbed's task)."""
        self.name, self.function, self.call, self.text = spec.name, spec.function, call, text
        self.images, self.key = spec.images, spec.key
        self.metadata = spec.prompt_metadata if spec.metadata else None
        self.memo = SharedCall(f"{spec.function}|{sorted(spec.settings.items())!r}") if spec.key else None

    @classmethod
    def from_spec(cls, spec: PythonRewardSpec) -> "PythonReward":
        target = resolve(spec.function)
        if inspect.isclass(target):
            try:
                call = target(**spec.settings)
            except Exception as err:
                raise ValueError(f"reward {spec.name!r}: building {spec.function} with settings {spec.settings} "
                                 f"raised {type(err).__name__}: {err}") from err
        else:
            settings = dict(spec.settings)

            def call(*inputs: list[Any]) -> Any:
                return target(*inputs, **settings)
        text = None if spec.text is None else VerifierReward.from_spec(spec.text)
        return (GroupwisePythonReward if spec.groupwise else cls)(spec, call, text)

    def inputs(self, samples: Tensor, cond: Tensor | list[str]) -> tuple[list[Any], ...]:
        """What the function is called with: (images, prompts), or for a language model (completions, prompts,
        answers), decoded from token ids."""
        if self.text is None:
            prompts = to_prompts(cond)
            if self.metadata is None:
                return to_images(samples, self.images), prompts
            return to_images(samples, self.images), prompts, [self.metadata.get(p, {}) for p in prompts]
        prompts = [self.text.prompt_text(p) for p in cond]
        completions = [self.text.codec.decode(c) for c in samples]
        return completions, prompts, [self.text.reference_answer(p) for p in cond]

    def score(self, samples: Tensor, cond: Tensor | list[str]) -> Tensor:
        return self.call_function(self.inputs(samples, cond))

    def call_function(self, inputs: tuple[list[Any], ...]) -> Tensor:
        try:
            out = self.call(*inputs) if self.memo is None else self.memo(self.call, inputs)
        except Exception as err:
            raise RewardFunctionError(f"reward {self.name!r} ({self.function}) raised {type(err).__name__}: "
                                      f"{err}") from err
        if isinstance(out, dict) != (self.key is not None):
            raise RewardFunctionError(
                f"reward {self.name!r} ({self.function}) returned a dict of named scores {list(out)[:8]}: list the "
                "ones to use in `keys`" if isinstance(out, dict) else
                f"reward {self.name!r} ({self.function}) has keys but returned a {type(out).__name__}, not a dict "
                "of named scores")
        if self.key is not None:
            if self.key not in out:
                raise RewardFunctionError(f"reward {self.name!r} ({self.function}) returned no score {self.key!r} "
                                          f"(its keys: {list(out)})")
            out = out[self.key]
        return as_scores(self.name, self.function, out, len(inputs[0]))

    def score_items(self, prompts: list[str | list[int]], completions: list[str | list[int]]) -> tuple[Tensor, Tensor]:
        """Text or token-id items (the arith REST route): (scores, scores): a function gives no verdict."""
        if self.text is None:
            raise ValueError(f"reward {self.name!r} scores images, not text")
        c = [x if isinstance(x, str) else self.text.codec.decode(x) for x in completions]
        p = [x if isinstance(x, str) else self.text.prompt_text(x) for x in prompts]
        scores = self.call_function((c, p, [self.text.reference_answer(x) for x in prompts]))
        return scores, scores

    def health_probe(self) -> None:
        """None: a user's function is scored on real batches only (a probe input might not suit it)."""
        return None


class GroupwisePythonReward(PythonReward):
    """A user's function called once per prompt group (`groupwise: true`); `reward.base.GroupwiseRewardModel`."""

    def score_groups(self, samples: Tensor, cond: Tensor | list[str], group: Tensor | None) -> Tensor:
        """Each group's scores from one call with its samples, in batch order (None: one group)."""
        if group is None:
            return self.score(samples, cond)
        inputs, out = self.inputs(samples, cond), torch.empty(samples.shape[0], dtype=torch.float32)
        for g in dict.fromkeys(group.tolist()):  # groups in order of first appearance
            idx = torch.nonzero(group == g).flatten().tolist()
            out[idx] = self.call_function(tuple([column[i] for i in idx] for column in inputs))
        return out


def as_scores(name: str, function: str, out: Any, batch: int) -> Tensor:
    """A function's return as [B] float32; an error naming the reward for a wrong length or non-numbers."""
    try:
        values = torch.as_tensor(np.asarray(out, dtype=np.float64)).flatten()
    except (TypeError, ValueError) as err:
        raise RewardFunctionError(f"reward {name!r} ({function}) returned {type(out).__name__}, not {batch} "
                                  f"numbers: {err}") from err
    if np.ndim(out) > 1 or len(values) != batch:
        raise RewardFunctionError(f"reward {name!r} ({function}) returned {len(values)} scores of shape "
                                  f"{tuple(np.shape(out))} for {batch} samples: one number per sample is needed")
    return values.to(torch.float32)


class SharedCall:
    """The last call of one function with its settings, shared by the columns of its named scores in this process:
    the columns of one batch (the same inputs) call the function once."""

    last: dict[str, tuple[str, Any]] = {}

    def __init__(self, identity: str):
        self.identity = identity

    def __call__(self, call: Callable[..., Any], inputs: tuple[list[Any], ...]) -> Any:
        digest = hashlib.sha256(pickle.dumps(inputs)).hexdigest()
        seen = SharedCall.last.get(self.identity)
        if seen is None or seen[0] != digest:
            seen = (digest, call(*inputs))
            SharedCall.last[self.identity] = seen
        return seen[1]
