"""Settings of the generative model and its sampler (each default defined here, once)."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from steadyrl.rollout.settings_base import StrictModel


class UNetConfig(StrictModel):
    """A class-conditional diffusers `UNet2DModel` (epsilon prediction)."""

    sample_size: int = Field(8, ge=4)
    channels: int = Field(1, ge=1)
    block_out_channels: tuple[int, ...] = (32, 64)
    layers_per_block: int = Field(1, ge=1)
    attention: bool = False
    norm_num_groups: int = Field(8, ge=1)
    num_classes: int = Field(10, ge=1)

    @field_validator("block_out_channels")
    @classmethod
    def _divisible(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(c <= 0 for c in v):
            raise ValueError("block_out_channels must be positive")
        return v


class SchedulerConfig(StrictModel):
    """The DDPM/DDIM noise schedule (diffusers `DDIMScheduler`)."""

    num_train_timesteps: int = Field(1000, ge=10)
    beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = "squaredcos_cap_v2"
    timestep_spacing: Literal["leading", "trailing", "linspace"] = Field(
        "leading", description="leading (DDIM default); trailing starts at t=T-1, where eps-prediction is ill-posed")


class SamplerBase(StrictModel):
    """Settings every sampler has; `kind` picks the sampler (and what the model predicts)."""

    num_steps: int = Field(10, ge=2, le=1000)
    logp_reduce: Literal["mean", "sum"] = Field(
        "mean", description="log-prob reduction over pixels (DDPO: mean); clip ranges and KL scales are stated for it")
    group_size: int = Field(16, ge=2, description="samples per prompt (per class on digits): one GRPO group")
    min_std: float = Field(1e-3, gt=0.0, description="steps with a smaller std are deterministic, untrained")

    prediction: ClassVar[str]  # what the model predicts: "epsilon", "velocity" or "tokens"

    # what the learner's update paths ask of a sampler (trainer/update_path.py), known from the settings alone
    @property
    def sequence_level(self) -> bool:
        """The training steps are Monte-Carlo samples of one sequence likelihood (a language model), not Gaussian
        transitions x_t -> x_{t-1} (an image model's steps)."""
        return self.prediction == "tokens"

    @property
    def redraws_token_masks(self) -> bool:
        """The learner scores the new policy on masks of its own, not on the rollout's: the old and new per-token
        log-probs are then of different positions."""
        return False


class SDEWindowConfig(StrictModel):
    """Which steps of a rollout are SDE (and trained): `size` consecutive stochastic steps from a start
    that is fixed, slides with the training step (MixGRPO) or is drawn per training step (Flow-GRPO-Fast).
    Positions count the sampler's stochastic steps (std >= min_std), 0 = the noisiest."""

    size: int = Field(..., ge=1, description="SDE (trained) steps in the window: MixGRPO 4, Flow-GRPO-Fast 3 "
                      "(its *_fast_nocfg presets; 2 in its config/base.py and Qwen-Image presets)")
    start: int = Field(0, ge=0, description="the fixed start, the first start of a sliding window, or the lowest "
                       "start a random window may draw")
    shift_every: int | None = Field(None, ge=1, description="MixGRPO's sliding window: the start moves by `stride` "
                                    "every this many training steps (MixGRPO 25, Flash 20); None = no sliding")
    stride: int = Field(1, ge=1, description="steps the sliding window moves at each shift (MixGRPO 1)")
    at_end: Literal["stop", "restart"] = Field(
        "stop", description="a sliding window past the last start: stop there (MixGRPO's default clip) or "
        "restart from `start` (MixGRPO's roll_back)")
    random: bool = Field(False, description="Flow-GRPO-Fast: a uniform start in [start, start_max] per training "
                         "step, from a generator seeded by (run.seed, step)")
    start_max: int | None = Field(
        None, ge=0, description="random windows: the highest start drawn (inclusive), so the SDE stays in the noisy "
        "half of the grid where Flow-GRPO-Fast trains; flow_grpo draws random.randint(lo, hi - size) from "
        "sde_window_range = (lo, hi) = (0, num_steps // 2), i.e. start_max = num_steps // 2 - size (2 for 10 steps, "
        "size 3). None: the last start that keeps the window on the stochastic steps")
    after: Literal["euler", "dpm_solver++"] = Field(
        "euler", description="the steps after the window's last SDE step (never trained, no log-prob). euler: the "
        "rest of the sampler's grid by deterministic Euler steps (MixGRPO; its --dpm_algorithm_type null). "
        "dpm_solver++: MixGRPO-Flash and Flash* (--dpm_algorithm_type dpmsolver++ --dpm_apply_strategy post): the rest "
        "of the grid compressed to fewer points (dpm_post_compress_ratio) and solved by multistep DPM-Solver++ seeded "
        "with the data predictions of the steps before it, fewer model calls per rollout (rollout/dpm_solver.py)")
    dpm_post_compress_ratio: float = Field(
        0.4, gt=0.0, le=1.0, description="after=dpm_solver++: the tail gets int(max((num_steps - last) * ratio, 1)) "
        "grid points (one step fewer), last = the window's last SDE step, on MixGRPO's shifted grid from the window's "
        "end to 0 (rollout/flow_grid.py); their --dpm_post_compress_ratio, Flash 0.4, Flash* 0.2")
    dpm_solver_order: Literal[1, 2, 3] = Field(
        2, description="after=dpm_solver++: the multistep order (their --dpm_solver_order; 2 in the Flash scripts); "
        "the tail's last step is always first order, as theirs")
    dpm_solver_type: Literal["midpoint", "heun"] = Field(
        "midpoint", description="after=dpm_solver++: the second-order update's form (their --dpm_solver_type; "
        "midpoint in the Flash scripts, their argparse default heun)")

    @model_validator(mode="after")
    def _one_motion(self) -> "SDEWindowConfig":
        if self.random and self.shift_every is not None:
            raise ValueError("sampler.sde_window: random=true and shift_every are two ways to move the window; "
                             "set one (shift_every=None for Flow-GRPO-Fast's random window)")
        if self.start_max is not None and not self.random:
            raise ValueError("sampler.sde_window.start_max bounds a random window's start: set random=true, or "
                             "leave start_max unset")
        if self.start_max is not None and self.start_max < self.start:
            raise ValueError(f"sampler.sde_window.start_max={self.start_max} is below start={self.start}: the "
                             "random start is drawn from [start, start_max]")
        return self


def check_window_on_grid(w: SDEWindowConfig | None, num_steps: int) -> None:
    """The window (its fixed start, or its highest random start) fits a grid of `num_steps` steps."""
    if w is not None and w.start + w.size > num_steps:
        raise ValueError(f"sampler.sde_window: start={w.start} + size={w.size} runs past the grid's "
                         f"num_steps={num_steps} steps")
    if w is not None and w.start_max is not None and w.start_max + w.size > num_steps:
        raise ValueError(f"sampler.sde_window: start_max={w.start_max} + size={w.size} runs past the grid's "
                         f"num_steps={num_steps} steps")


class DDIMSamplerConfig(SamplerBase):
    """DDIM on an epsilon-prediction UNet, eta > 0 so that every step but the last is a Gaussian policy."""

    kind: Literal["ddim"] = "ddim"
    prediction: ClassVar[str] = "epsilon"
    eta: float = Field(1.0, gt=0.0, le=1.0)
    sde_window: SDEWindowConfig | None = Field(
        None, description="None: every stochastic step draws with sigma and is trained (DDPO). Set: only the "
        "window's steps do, the others are deterministic DDIM (eta = 0) and untrained: MixGRPO's and "
        "Flow-GRPO-Fast's window on DDIM, fewer trained steps per sample (rollout/sde_window.py)")

    @model_validator(mode="after")
    def _window_on_grid(self) -> "DDIMSamplerConfig":
        check_window_on_grid(self.sde_window, self.num_steps)
        if self.sde_window is not None and self.sde_window.after != "euler":
            raise ValueError("sampler.sde_window.after=dpm_solver++ solves a flow's tail (MixGRPO-Flash): DDIM's "
                             "steps after the window are deterministic DDIM; leave after=euler")
        return self


class FlowSDESamplerConfig(SamplerBase):
    """Flow-GRPO's SDE on a velocity-prediction (rectified-flow) UNet."""

    kind: Literal["flow_sde"] = "flow_sde"
    prediction: ClassVar[str] = "velocity"
    noise_level: float = Field(0.7, gt=0.0, le=2.0, description="a: sde_type=sde, sigma_s = a * sqrt(s / (1 - s)) "
                               "(Flow-GRPO 0.7, FLUX 0.9); sde_type=cps, std = s_next * sin(a pi / 2), a <= 1 "
                               "(flow_grpo's CPS presets 0.8)")
    sde_type: Literal["sde", "cps"] = Field(
        "sde", description="the SDE step (flow_grpo's sde_type). sde: Flow-GRPO's Euler-Maruyama step of the "
        "marginal-preserving SDE, Gaussian log-prob. cps: Coefficients-Preserving Sampling (arXiv 2509.05952, the "
        "step of flow_grpo's Flow-GRPO-Fast presets), x_next = x0_hat (1 - s_next) + eps_hat sqrt(s_next^2 - std^2) "
        "+ std z, whose noise keeps the sample on the flow's (1 - s) x0 + s eps coefficients; its log-prob is "
        "flow_grpo's -(x_next - mean)^2 with every constant and the 1/(2 std^2) scale dropped (a different ratio "
        "scale: clip ranges are not interchangeable with sde's)")
    shift: float = Field(1.0, gt=0.0, description="the grid's static timestep shift: FlowMatchEulerDiscreteScheduler's "
                         "(grid=scheduler; FLUX models take their scheduler config's instead), or sd3_time_shift's "
                         "(grid=sd3_time_shift; MixGRPO 3)")
    grid: Literal["scheduler", "sd3_time_shift"] = Field(
        "scheduler", description="the sigma grid. scheduler: diffusers' (FlowMatchEulerDiscreteScheduler(shift)."
        "set_timesteps(num_steps), as Flow-GRPO; FLUX: FluxPipeline's linspace(1, 1/N, N) shifted by mu(image size)). "
        "sd3_time_shift: MixGRPO's (and DanceGRPO's) sd3_time_shift(shift, linspace(1, 0, N + 1)), every point "
        "statically shifted, whatever the model's scheduler says (rollout/flow_grid.py)")
    integer_timesteps: bool = Field(
        False, description="call the model at int(sigma * 1000), the floor, as MixGRPO does in sampling and training "
        "(the step formulas keep sigma); false: at sigma * num_train_timesteps, as diffusers' schedulers. The floor "
        "reaches a FLUX transformer exactly only with float32 activations (testbed.dtype float32, autocast bfloat16, "
        "as MixGRPO's fp32 master weights under bf16 autocast): it casts the timestep to its input's dtype, and bf16 "
        "rounds timesteps near 1000 to multiples of 4")
    sde_window: SDEWindowConfig | None = Field(
        None, description="None: every stochastic step is an SDE step and trained (Flow-GRPO). Set: SDE steps only "
        "inside this window, deterministic Euler (ODE) steps elsewhere, only the window trained (MixGRPO, "
        "Flow-GRPO-Fast; rollout/sde_window.py)")

    @model_validator(mode="after")
    def _window_on_grid(self) -> "FlowSDESamplerConfig":
        if self.sde_type == "cps" and self.noise_level > 1:
            raise ValueError(f"sampler.noise_level={self.noise_level} with sde_type=cps: std = s_next sin(a pi / 2) "
                             "peaks at a = 1 (all of the step's noise fresh) and folds back above it; use a <= 1 "
                             "(flow_grpo: 0.8)")
        check_window_on_grid(self.sde_window, self.num_steps)
        return self


class MaskedDiffusionSamplerConfig(SamplerBase):
    """LLaDA-style masked-diffusion generation and the likelihood estimator its ratios use (dLLMs).
    `num_steps` are denoising steps over the whole completion; a training "step" is one MC mask sample."""

    kind: Literal["masked_diffusion"] = "masked_diffusion"
    prediction: ClassVar[str] = "tokens"
    num_steps: int = Field(4, ge=1, le=4096, description="denoising steps (a multiple of the number of blocks)")
    gen_length: int = Field(4, ge=1, description="completion tokens (fixed; the answer, then <eos>)")
    block_length: int | None = Field(None, ge=1, description="semi-autoregressive block; None = gen_length")
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    temperature: float = Field(1.0, ge=0, description="Gumbel-noise temperature; 0 = greedy (deterministic)")
    cfg_scale: float = Field(0.0, ge=0, description="classifier-free guidance w: u + (w + 1)(c - u); 0 = off")
    estimator: Literal["elbo", "coupled", "one_step"] = Field(
        "elbo", description="sequence log-likelihood estimator (rollout/likelihood.py)")
    mc_samples: int = Field(2, ge=1, le=256, description="n Monte-Carlo mask samples per sequence")
    masks: Literal["shared", "independent"] = Field(
        "shared", description="shared: old, new and reference policy see the rollout's masks (on policy the "
        "ratio is then exactly 1); "
        "independent: every likelihood evaluation draws its own (StableDRL's noisy-ratio setting)")
    mask_scheme: Literal["uniform", "stratified", "block_random"] = Field(
        "uniform", description="how elbo/coupled masks are drawn (rollout/likelihood.py): uniform (each MC "
        "sample's count l ~ U{1..L} on its own), stratified (LLaDA's likelihood: the n counts of a sequence "
        "spread evenly over 1..L, lower variance at the same cost), block_random (SPG/StableDRL: one block per "
        "MC sample partly masked, later positions masked, earlier ones and the prompt with prompt_mask_prob; "
        "blocks of block_length; elbo only)")
    stratified_batch_size: int | None = Field(
        None, ge=1, description="mask_scheme=stratified: MC samples per shared draw k. LLaDA's get_log_likelihood "
        "loops mc_num // batch_size times and draws one k per mini-batch of batch_size samples (theirs: 128 / 16), "
        "so its counts are spread evenly within each mini-batch, not over all n; set it to reproduce their masks "
        "for the same k draws. None: one k for all mc_samples (LLaDA with batch_size = mc_num). Must divide "
        "mc_samples, as their loop leaves no partial mini-batch")
    prompt_mask_prob: float = Field(0.15, ge=0, lt=1, description="p: prompt tokens masked with this probability "
                                    "by the one_step estimator (d1) and, with the positions before the chosen "
                                    "block, by mask_scheme=block_random (SPG)")
    logp_reduce: Literal["mean", "sum"] = Field(
        "mean", description="sum: the estimate of log pi(y|x); mean: divided by the completion's scored length "
        "(mean log-prob over the masked tokens for the elbo estimator, the per-sample form of SPG's code)")
    score_after_eos: bool = Field(
        False, description="score the whole fixed-length canvas, tokens after the first EOS included. False (d1, "
        "SPG/StableDRL): positions after a completion's first EOS are masked in the model's input and left out of "
        "every likelihood term, the EUBO and the mask counts, so padding never moves a ratio")
    attend_pads: bool = Field(
        False, description="true: call the model without an attention mask, so left-padded prompt rows attend to "
        "their pad tokens, in generation and every likelihood pass: d1's code (diffu-grpo's generate and "
        "get_logits, the path of _get_per_token_logps, call model(x); the tokenizer's prompt mask is never "
        "passed), for reproducing grpo.d1 runs exactly. False (the default; SPG's and LLaDA's generate.py): the "
        "pads are masked out, so a padded row generates and scores as its prompt alone would and a completion's "
        "likelihood does not depend on how long the batch's other prompts are")
    group_size: int = Field(8, ge=2, description="completions per prompt: one GRPO group")

    @property
    def redraws_token_masks(self) -> bool:
        """Independent masks redraw the completion's positions unless every position is masked (one_step: then
        only the prompt's are redrawn)."""
        return self.masks == "independent" and self.estimator != "one_step"

    @model_validator(mode="after")
    def _blocks(self) -> "MaskedDiffusionSamplerConfig":
        block = self.block_length or self.gen_length
        if self.gen_length % block:
            raise ValueError(f"gen_length={self.gen_length} must be a multiple of block_length={block}")
        if self.num_steps % (self.gen_length // block):
            raise ValueError(f"num_steps={self.num_steps} must be a multiple of the number of blocks "
                             f"({self.gen_length // block})")
        if self.mask_scheme != "uniform" and self.estimator == "one_step":
            raise ValueError(f"sampler.mask_scheme={self.mask_scheme} applies to the elbo and coupled estimators; "
                             "one_step masks the whole completion")
        if self.mask_scheme == "block_random" and self.estimator != "elbo":
            raise ValueError("sampler.mask_scheme=block_random needs sampler.estimator=elbo (coupled's complement "
                             "of a block mask would unmask the later blocks)")
        if self.stratified_batch_size is not None and self.mask_scheme != "stratified":
            raise ValueError(f"sampler.stratified_batch_size={self.stratified_batch_size} applies to "
                             f"mask_scheme=stratified, got {self.mask_scheme}: unset it or use stratified")
        if self.stratified_batch_size is not None and self.mc_samples % self.stratified_batch_size:
            raise ValueError(f"sampler.stratified_batch_size={self.stratified_batch_size} must divide "
                             f"sampler.mc_samples={self.mc_samples} (LLaDA's loop draws whole mini-batches)")
        return self


class VLLMEngineConfig(StrictModel):
    """The vLLM engine a rollout worker hosts (`sampler.backend: vllm`; the `vllm` extra, README "vLLM")."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the engine's weights and activations; float32 keeps its log-probs within the "
        "stated tolerance (1e-4 per token) of the learner's; a bf16 engine is held only to the learner's recompute, "
        "which weighs its samples")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=0.95, description="share of the GPU the engine may take "
                                          "(weights + KV cache); the rest stays for a colocated learner")
    cpu_kv_cache_gib: int = Field(1, ge=1, description="vLLM's CPU backend: KV-cache size in GiB "
                                  "(VLLM_CPU_KVCACHE_SPACE)")
    enforce_eager: bool = Field(True, description="no CUDA graphs / torch.compile: starts in seconds; set false on "
                                "GPUs for throughput once a run is long")
    max_num_seqs: int = Field(256, ge=1, description="sequences the engine batches at once")
    seed: int = Field(0, description="the engine's own seed (each completion also gets a per-row seed from the "
                      "step's generator, so a step's samples replay exactly)")


class AutoregressiveSamplerConfig(SamplerBase):
    """Token-by-token sampling of a causal LM, whose sequence log-likelihood is exact:
    log pi(y | x) = sum_t log softmax(logits_t / T)[y_t] over the positions up to the first EOS. A training "step"
    is that one exact likelihood (no Monte-Carlo masks). `backend` picks who generates: `transformers` (this
    process, a KV-cached loop) or `vllm` (an engine inside the rollout worker); the learner always recomputes."""

    kind: Literal["autoregressive"] = "autoregressive"
    prediction: ClassVar[str] = "tokens"
    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="transformers: always installed; vllm: the `vllm` extra, the engine living in "
        "the rollout worker and the learner's weights pushed into it after every update")
    num_steps: int = Field(1, ge=1, le=1, description="one: the exact sequence likelihood (kept for the shared seam)")
    gen_length: int = Field(8, ge=1, description="most completion tokens (generation stops at EOS)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature T; the behaviour policy is "
                               "softmax(logits / T), which the learner's log-probs use too. 0 = greedy")
    logp_reduce: Literal["mean", "sum"] = Field(
        "sum", description="sum: log pi(y|x) exactly; mean: divided by the completion's length up to its EOS")
    group_size: int = Field(8, ge=2, description="completions per prompt: one GRPO group")
    vllm: VLLMEngineConfig = Field(default_factory=VLLMEngineConfig, description="backend=vllm: the engine")


class BlockDiffusionSamplerConfig(SamplerBase):
    """Uniform-noise block diffusion (DiffusionGemma): the completion is generated block by block, each block a canvas
    of random tokens refined by entropy-bound acceptance until it is stable and confident, then committed as its
    argmax (rollout/block_diffusion.py). A training "step" is one Monte-Carlo noise draw of the likelihood estimator.
    `backend` picks who generates: `transformers` (this process) or `vllm` (an engine in the rollout worker; GPU
    only in vLLM 0.32); the learner computes every likelihood itself either way."""

    kind: Literal["block_diffusion"] = "block_diffusion"
    prediction: ClassVar[str] = "tokens"
    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="transformers: steadyrl's own sampler, always installed; vllm: the `vllm` extra's "
        "DiffusionGemma engine in the rollout worker (vLLM samples diffusion models only on GPUs)")
    gen_length: int = Field(4, ge=1, description="completion tokens: a whole number of canvases")
    canvas_length: int | None = Field(None, ge=1, description="tokens per block (canvas); None = gen_length")
    num_steps: int = Field(8, ge=1, le=4096, description="most denoising steps per block (DiffusionGemma's "
                           "max_denoising_steps; a block stops earlier once stable and confident)")
    t_min: float = Field(0.4, gt=0, description="temperature at the last step (linear schedule t_max -> t_min)")
    t_max: float = Field(0.8, gt=0, description="temperature at the first step")
    entropy_bound: float = Field(0.1, gt=0, description="accept the lowest-entropy positions while "
                                 "sum(H) - max(H) <= bound (an upper bound on their mutual information)")
    confidence_threshold: float = Field(0.005, gt=0, description="a block is confident when its mean entropy is "
                                        "below this")
    stability_threshold: int = Field(1, ge=0, description="steps the argmax canvas must stay unchanged")
    mc_samples: int = Field(2, ge=1, le=256, description="n Monte-Carlo noise draws per sequence")
    masks: Literal["shared", "independent"] = Field(
        "shared", description="shared: old, new and reference policy see the rollout's noise draws (on policy the "
        "ratio is then exactly 1); independent: every likelihood evaluation draws its own")
    self_conditioning: bool = Field(
        True, description="score each noise draw as the sampler denoises from its second step on: conditioned on the "
        "model's own no-grad first guess at the same canvas (two forward passes; the gradient flows through the "
        "second); false: one pass without self-conditioning (the sampler's first step)")
    logp_reduce: Literal["mean", "sum"] = Field(
        "mean", description="sum: the estimate of log pi(y|x); mean: divided by the completion's length up to EOS")
    group_size: int = Field(8, ge=2, description="completions per prompt: one GRPO group")
    vllm: VLLMEngineConfig = Field(default_factory=VLLMEngineConfig, description="backend=vllm: the engine")

    @property
    def block(self) -> int:
        return self.canvas_length or self.gen_length

    @property
    def redraws_token_masks(self) -> bool:
        return self.masks == "independent"

    @model_validator(mode="after")
    def _blocks(self) -> "BlockDiffusionSamplerConfig":
        if self.gen_length % self.block:
            raise ValueError(f"sampler.gen_length={self.gen_length} must be a multiple of sampler.canvas_length="
                             f"{self.block} (vLLM emits whole canvases)")
        if self.t_min > self.t_max:
            raise ValueError(f"sampler.t_min={self.t_min} must not exceed sampler.t_max={self.t_max}")
        return self


DEFAULT_SAMPLER_KIND = "ddim"


def _sampler_kind(value: Any) -> str:
    """`kind` of a sampler section; a section without one is DDIM (the presets written before flow)."""
    default = DEFAULT_SAMPLER_KIND
    return value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", default)


SamplerConfig = Annotated[
    Union[Annotated[DDIMSamplerConfig, Tag("ddim")], Annotated[FlowSDESamplerConfig, Tag("flow_sde")],
          Annotated[MaskedDiffusionSamplerConfig, Tag("masked_diffusion")],
          Annotated[AutoregressiveSamplerConfig, Tag("autoregressive")],
          Annotated[BlockDiffusionSamplerConfig, Tag("block_diffusion")]],
    Discriminator(_sampler_kind),
]
