"""The model card an export writes beside the weights: README.md with YAML front matter (what the hub and its
readers index), then what was trained, how, how well, and how to load it.

    ---
    base_model: <hub id or directory>       library_name: diffusers | transformers | peft
    tags: [steadyrl, reinforcement-learning, <objective>, <testbed>, lora?]
    ---
    settings (objective, sampler, learner, LoRA), base-vs-final evaluation, the load snippet, the command
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class ExportInfo:
    """What an export wrote (`Testbed.export`), for its model card and the command's summary."""

    format: str  # in words: "LoRA adapters in peft's format for diffusers' load_lora_weights"
    library: str  # the library a user loads it with: diffusers, transformers, peft
    load: str  # Python that loads it; "{path}" stands for the export folder
    base_model: str | None = None  # hub id or directory of the base it needs (None: self-contained)
    tags: tuple[str, ...] = field(default=())


def steadyrl_version() -> str:
    try:
        return version("steadyrl")
    except PackageNotFoundError:
        return "unknown"


def evaluation_rows(evals: list[dict[str, Any]], step: int) -> list[tuple[str, Any, Any]]:
    """(figure, base, at `step`) for each number the first and the step's evaluation share (the base is the first:
    step 0); none without both."""
    base = next((e for e in evals if e.get("step") == 0), None)
    final = next((e for e in evals if e.get("step") == step), None)
    if base is None or final is None:
        return []
    return [(k, base[k], final[k]) for k in base
            if k != "step" and isinstance(base[k], (int, float)) and isinstance(final.get(k), (int, float))]


def model_card(cfg: Any, evals: list[dict[str, Any]], step: int, info: ExportInfo, command: str) -> str:
    """README.md of an export of checkpoint `step` of a run with config `cfg` (a TrainConfig)."""
    testbed, objective = cfg.testbed.name, cfg.objective.name
    lora = getattr(cfg.testbed, "lora", None)
    tags = ["steadyrl", "reinforcement-learning", objective, testbed, *(["lora"] if lora is not None else []),
            *info.tags]
    front = {"library_name": info.library, "tags": list(dict.fromkeys(tags))}
    if info.base_model is not None:
        front = {"base_model": info.base_model, **front}
    settings = {"objective": cfg.objective.model_dump(), "sampler": cfg.sampler.model_dump(),
                "learner": {k: v for k, v in cfg.learner.model_dump().items() if k in ("lr", "grad_clip", "epochs")},
                **({"lora": lora.model_dump()} if lora is not None else {}), "steps": step}
    rows = evaluation_rows(evals, step)
    table = "\n".join(["| figure | base (step 0) | step " + str(step) + " |", "|---|---|---|",
                       *(f"| {k} | {b:.4g} | {f:.4g} |" for k, b, f in rows)]) if rows else "No evaluation at this step."
    load = info.load.replace("{path}", "path/to/this/folder")
    return "\n".join([
        "---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
        f"# {cfg.run.name}: {objective} on {testbed}", "",
        f"RL fine-tuned with steadyrl {steadyrl_version()} ({objective}, checkpoint of step {step}). "
        f"{info.format}" + (f", on the base model `{info.base_model}`." if info.base_model else "."), "",
        "## Evaluation", "", table, "",
        "## Load it", "", f"```python\n{load.strip()}\n```", "",
        "## Training settings", "", f"```yaml\n{yaml.safe_dump(settings, sort_keys=False).strip()}\n```", "",
        "## Made by", "", f"```bash\n{command}\n```", "",
    ])


def write_model_card(folder: Path, cfg: Any, evals: list[dict[str, Any]], step: int, info: ExportInfo,
                     command: str) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(model_card(cfg, evals, step, info, command))
    return path
