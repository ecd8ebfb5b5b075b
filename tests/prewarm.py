"""Build the suite's slowest cached artefacts in the background, on a core the tests leave idle.

    python -m tests.prewarm        # tests/conftest.py starts it at nice 10 under STEADYRL_TEST_PREWARM=1 (make test)

On an empty cache a test that first needs a preset's pre-trained base builds it itself, single-threaded (one to
1.5 min each for the arith bases), and the first DeepSpeed engine compiles its CPU op (~50 s) while the other core
mostly idles: the test process's own torch work runs on one thread. This builds them in the order the suite first
needs them. A test asking for an artefact being built here waits for it (`rollout.cache.build_dir_atomically`'s
lock; torch's own for the op) instead of building it again; one asking for another builds that one itself. The
artefacts are the same bytes whichever process builds them (`rollout.cache.reproducible_build`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the presets whose bases (and, for digits, the classifier ensemble) the suite builds, in the order it needs them
PRESETS = ("digits-grpo", "arith-ar-grpo", "arith-bd-grpo", "arith-grpo", "digits-flow-grpo")


def build_deepspeed_cpu_op() -> None:
    """The shared-memory collective op DeepSpeed's CPU accelerator loads at its first engine, compiled into the
    cache's TORCH_EXTENSIONS_DIR, in the environment a learner actor has (`services.runtime.ray_session.worker_env`)."""
    from steadyrl.services.runtime.ray_session import worker_env

    for key, value in worker_env().items():  # what every actor gets: the cache's TORCH_EXTENSIONS_DIR among them
        os.environ.setdefault(key, value)
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    ShareMemCommBuilder().load(verbose=False)


def build_preset(name: str) -> None:
    """`steadyrl pretrain configs/<name>.yaml`: the base model and the testbed's reward models."""
    from steadyrl.services.driver.cli import pretrain

    pretrain([str(ROOT / "configs" / f"{name}.yaml")])


def main() -> None:
    for what, build in [("deepspeed cpu op", build_deepspeed_cpu_op),
                        *((name, lambda name=name: build_preset(name)) for name in PRESETS)]:
        build()
        print(f"prewarm: {what} ready", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
