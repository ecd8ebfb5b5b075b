"""The testbed interface: what the services read instead of constants (see the package docstring)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

from steadyrl.reward.ensemble import EnsembleScores, RewardEnsemble, finite_mean
from steadyrl.reward.ensemble_spec import EnsembleSpec
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.services.testbeds.rest import RestProfile
from steadyrl.services.testbeds.settings import TestbedSettings

if TYPE_CHECKING:
    from steadyrl.services.config import TrainConfig
    from steadyrl.services.run_folder.model_card import ExportInfo


class PromptError(ValueError):
    """A prompt (or prompts file) a testbed cannot take; the message names it."""


class Testbed(ABC):
    """One testbed of a run's config. Prompts are integer tensors: class ids [C] or prompt tokens [C, P].

    A testbed class names its config section (`Settings`, a `TestbedSettings`: the run's `testbed:`), what its
    reward app accepts over REST (`rest`), and implements the data half (policy, sampler, prompts) and the
    scoring half (reward ensemble, held-out figure, evaluation) below."""

    name: ClassVar[str]
    Settings: ClassVar[type[TestbedSettings]]
    rest: ClassVar[RestProfile]
    #: (label of the training reward, label of the held-out accuracy) in progress bars and tables
    labels: tuple[str, str] = ("proxy", "gold")
    #: format of the headline held-out figure (`held_out`) and its breakdown: an accuracy, or a score
    headline_format: str = ".1%"

    def __init__(self, cfg: "TrainConfig"):
        self.cfg = cfg
        self.settings = cfg.testbed

    # ------------------------------------------------------------------ data half
    @abstractmethod
    def base_weights(self, progress: bool = True) -> Path:
        """The pre-trained policy's weights (built and cached on first use)."""

    @abstractmethod
    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        """The policy network holding `weights`, in eval mode."""

    def build_rollout_policy(self, weights: dict[str, Tensor], device) -> nn.Module:
        """What a rollout worker samples with: the policy on `device`, unless the testbed's sampler backend holds
        one of its own (an inference engine, which then loads every weight sync)."""
        return self.build_policy(weights).to(device)

    def export(self, policy: nn.Module, out: Path, merge: bool = False) -> "ExportInfo":
        """Write `policy` (a checkpoint's, from `build_policy`) into the empty folder `out` in the format its
        ecosystem loads (`steadyrl export`, services/driver/export.py): LoRA adapters as peft / diffusers read them
        (`merge`: fused into a whole model folder), a whole model as `save_pretrained` writes it; returns what it
        wrote, for the model card."""
        raise NotImplementedError(f"testbed {self.name!r} has no export yet")

    def export_sources(self) -> list[tuple[str, str]]:
        """(setting, hub id or directory) of the models an export loads to build the checkpoint's policy (its base),
        checked by `steadyrl export` before anything is written; none by default."""
        return []

    def preflight(self) -> None:
        """Checks that need the testbed built (token ids, prompt lengths), run before Ray starts: a bad setting
        fails here with its name rather than in an actor."""
        self.build_sampler()

    def model_sources(self) -> list[tuple[str, str]]:
        """(setting, hub id or directory) of every model a run loads (`require_models` checks them): the reward
        models' by default; a testbed adds its policy's."""
        return self.reward_model_sources()

    def reward_model_sources(self) -> list[tuple[str, str]]:
        """The reward models' share of `model_sources` (all that `steadyrl serve-reward` loads); none by default."""
        return []

    def require_models(self, rewards_only: bool = False) -> None:
        """A `ConfigError` naming each model (with `rewards_only`: each reward model) that is neither a local
        directory nor in the hub cache (online: nor served by the hub), or a remote scorer (`kind: http`) that no
        server of its protocol answers for, raised before Ray starts and before a run folder exists; otherwise a
        loader fails later, in an actor, with a long traceback."""
        from steadyrl.reward.http_reward import HttpRewardSpec, probe_remote_scorer
        from steadyrl.reward.http_transport import RemoteScorerError
        from steadyrl.rollout.model_sources import ModelsUnavailable, check_model_sources
        from steadyrl.rollout.settings_base import ConfigError

        try:
            check_model_sources(self.reward_model_sources() if rewards_only else self.model_sources())
        except ModelsUnavailable as err:
            raise ConfigError(str(err)) from None
        spec = self.reward_spec()
        for remote in [s for s in [*spec.members, *spec.monitors] if isinstance(s, HttpRewardSpec)]:
            try:
                probe_remote_scorer(remote)
            except RemoteScorerError as err:
                raise ConfigError(str(err)) from None

    @abstractmethod
    def build_sampler(self):
        """The sampler of `cfg.sampler`, ready for this testbed's policy."""

    @abstractmethod
    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        """(prompts of `worker` at `step`, its first group id; group ids never collide across workers)."""

    @abstractmethod
    def eval_prompts(self) -> Tensor:
        """The fixed held-out prompts of every evaluation."""

    def prompts_from_text(self, texts: list[str]) -> Tensor:
        """Prompt ids of prompts a person wrote (`steadyrl sample --prompts`, `Run.sample(prompts=[...])`), as
        `eval_prompts` gives them: digits' class ids ("3", "0,1,2"), arith's problems encoded by its tokenizer, a
        text-to-image prompt's id. A `PromptError` names a prompt the testbed cannot take."""
        raise PromptError(f"testbed {self.name!r} does not take prompts as text")

    def sample_options(self, policy: nn.Module, prompts: Tensor) -> dict[str, Any]:
        """Extra keyword arguments of `sampler.sample` for these prompt ids (text-to-image: the prompts'
        embeddings as `cond_inputs`, the latent shape); none for class ids or prompt tokens."""
        return {}

    def sample(self, sampler, policy: nn.Module, prompts: Tensor, n_per_prompt: int, generator,
               group_offset: int = 0, **options: Any) -> RolloutBatch:
        """`n_per_prompt` samples of each prompt id through `sampler` (with this testbed's `sample_options`, and
        `options`: the training step of a windowed flow-SDE sampler)."""
        return sampler.sample(policy, prompts, n_per_prompt, generator, group_offset=group_offset,
                              **self.sample_options(policy, prompts), **options)

    def reward_inputs(self, policy: nn.Module, batch: RolloutBatch) -> tuple[Any, Any]:
        """(samples, cond) the reward models score: the batch's own, unless the testbed decodes them
        (text-to-image: VAE-decoded images and the prompt strings)."""
        return batch.samples, batch.cond

    def readable(self, policy: nn.Module, batch: RolloutBatch) -> tuple[list[Any], Tensor | list[str]]:
        """(each sample's prompt, the samples) as a person reads them (`Run.sample`): by default what the reward
        models see, `reward_inputs` (a class id or prompt text; images); a language model's decoded text."""
        samples, cond = self.reward_inputs(policy, batch)
        return (cond.tolist() if isinstance(cond, Tensor) else list(cond)), samples

    def eval_sampler(self):
        """The sampler evaluations use (the training sampler unless the testbed says otherwise)."""
        return self.build_sampler()

    @property
    def eval_per_prompt(self) -> int:
        """Samples per evaluation prompt."""
        return self.cfg.testbed.eval_samples_per_class

    # ------------------------------------------------------------------ scoring half
    @abstractmethod
    def prepare_rewards(self, console=None) -> None:
        """Build/check the reward models before Serve loads them (and print what was built)."""

    @abstractmethod
    def reward_spec(self) -> EnsembleSpec:
        """The testbed's reward ensemble: what the Serve app deploys (`services.serving.app.build_reward_app`)
        and the local runtime builds in-process (`reward_ensemble`)."""

    def reward_ensemble(self) -> RewardEnsemble:
        """The same reward models in this process (the local runtime, `steadyrl eval`)."""
        return self.reward_spec().build()

    @property
    @abstractmethod
    def gold_name(self) -> str:
        """The held-out monitor (never trained on) whose `<name>_correct` is the headline accuracy."""

    def rollout_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, float]:
        """Scalars of one rollout batch (sample-weighted across workers by the controller)."""
        from steadyrl.reward.diversity import mean_pairwise_distance, nearest_neighbour_distance

        gold_score, gold_headline = self.held_out(scores)
        out = {
            "reward/train_mean": finite_mean(scores.reward),
            "reward/ensemble_mean": finite_mean(scores.mean),
            "reward/ensemble_std": finite_mean(scores.std),
            "reward/uncertainty_mean": finite_mean(scores.uncertainty),
            "reward/gold_mean": float(gold_score.mean()),
            "reward/held_out": float(gold_headline.mean()),
            "diversity/nn_distance": (0.0 if scores.features is None else
                                      float(nearest_neighbour_distance(scores.features, batch.group).mean())),
            "diversity/pairwise_distance": (0.0 if scores.features is None else
                                            mean_pairwise_distance(scores.features, batch.group)),
        }
        for name, col in zip(scores.names, scores.scores.T):
            out[f"reward/{name}"] = finite_mean(col)
        return out

    def held_out(self, scores: EnsembleScores) -> tuple[Tensor, Tensor]:
        """(the gold monitor's score, its headline per sample): the gold classifier's or verifier's score and
        its 0/1 correctness (`<gold>_correct`)."""
        gold = self.gold_name
        return scores.monitors[gold], scores.monitors[f"{gold}_correct"]

    def headline(self, value: float, breakdown: bool = False) -> str:
        """The held-out figure as text (an accuracy as a percentage; a reward score as a number)."""
        fmt = ".0%" if breakdown and self.headline_format.endswith("%") else self.headline_format
        return format(value, fmt)

    def headline_text(self, value: float) -> str:
        """"gold accuracy 97.2%" / "held-out reward 0.312": the held-out figure with its name (picture titles)."""
        kind = "accuracy" if self.headline_format.endswith("%") else "reward"
        return f"{self.labels[1]} {kind} {self.headline(value)}"

    @abstractmethod
    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        """`held_out`, `proxy_mean`, `diversity_nn`, `breakdown` {label: accuracy} and `n_samples`,
        plus whatever `save_eval` draws (removed before the result is written as JSON)."""

    @abstractmethod
    def save_eval(self, result: dict[str, Any], path_stem: Path, title: str) -> None:
        """Write the evaluation's picture or examples next to `path_stem` (and pop what it used)."""
