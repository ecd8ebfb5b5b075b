"""steadyrl: reinforcement-learning fine-tuning of diffusion models, from Python.

    import steadyrl

    run = steadyrl.train("configs/digits-grpo.yaml", ["run.steps=20"], runtime="local")
    run.metrics[-1], run.evaluations[-1], run.last_checkpoint
    images = run.sample(4, seed=0).images
    run = steadyrl.load_run(run.folder)            # later, or in another notebook

This module is the package's front door (pyproject.toml maps `steadyrl` to services/api/): it imports nothing at
`import steadyrl`; each name below is imported on first use from where it lives (`train`, `load_run`, `Run`,
`Samples`: services/driver/api.py). The parts install beside it as steadyrl.rollout, steadyrl.reward,
steadyrl.trainer and steadyrl.services. docs/python-api.md describes the run object.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from steadyrl.rollout.settings_base import ConfigError
    from steadyrl.services.driver.api import Run, Samples, load_run, train
    from steadyrl.services.run_folder.checkpoints import RunFailed
    from steadyrl.services.run_folder.reader import NotARunFolder

__all__ = ["train", "load_run", "Run", "Samples", "ConfigError", "RunFailed", "NotARunFolder"]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (torch and the models load then, not at `import steadyrl`)."""
    if name in ("train", "load_run", "Run", "Samples"):
        from steadyrl.services.driver import api as module
    elif name == "ConfigError":
        from steadyrl.rollout import settings_base as module
    elif name == "RunFailed":
        from steadyrl.services.run_folder import checkpoints as module
    elif name == "NotARunFolder":
        from steadyrl.services.run_folder import reader as module
    else:
        raise AttributeError(f"module 'steadyrl' has no attribute {name!r}")
    value = globals()[name] = getattr(module, name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
