"""One cache directory for built artefacts, keyed by config, written atomically."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from steadyrl.rollout.numerics import using_threads


def cache_root() -> Path:
    """`$STEADYRL_CACHE`, else `~/.cache/steadyrl`."""
    root = Path(os.environ.get("STEADYRL_CACHE", Path.home() / ".cache" / "steadyrl")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def config_key(config: Any) -> str:
    """A short stable hash of a JSON-able config."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


BUILD_RECIPE = 2  # 2: single-threaded, bitwise reproducible pre-training (1 depended on the thread count)


def build_key(spec: dict[str, Any]) -> str:
    """config_key of a pre-trained artefact: its spec and the recipe that builds it, so an artefact built the
    old way is rebuilt rather than reused."""
    return config_key({**spec, "build_recipe": BUILD_RECIPE})


@contextmanager
def reproducible_build(seed: int) -> Iterator[torch.Generator]:
    """Seeded, single-threaded torch for building a cached artefact (pre-training); yields a generator.

    On one thread (`rollout.numerics.using_threads`) the artefact comes out bitwise the same whatever process
    builds it (a CLI, a test, an actor, on any number of cores); on more, float32 sums change order with the
    thread count and the drift compounds over training. The global RNG, seeded here for weight
    initialisation, is restored afterwards.
    """
    with torch.random.fork_rng(devices=[]), using_threads(1):
        torch.manual_seed(seed)
        yield torch.Generator().manual_seed(seed)


def torch_extensions_dir() -> Path:
    """Where DeepSpeed's compiled C++ ops are cached (set as TORCH_EXTENSIONS_DIR)."""
    path = cache_root() / "torch_extensions"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_dir_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp_dir)` and move the result to `target` in one rename.

    A crash mid-build leaves only a temp folder (removed), never a half-written `target`. A process that asks for
    an artefact another is building waits for it (`_building`) instead of building it a second time; if both
    built it anyway (the lock is advisory), the first result is kept.
    """
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _building(target):
        if target.exists():  # built by the process that held the lock
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.exists():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextmanager
def _building(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on `.<target>.lock` beside `target` while it is built (flock: released by the kernel
    if the holder dies). The file is removed on the way out; a process still waiting on it then finds `target`
    built, or, after a failed build, builds it itself."""
    lock = target.parent / f".{target.name}.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Write a small file via temp file + rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
