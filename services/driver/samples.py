"""`steadyrl sample RUN_DIR OUT`: what `Run.sample(...)` drew, written for a person to look at. The CLI and
`Samples.save` (services/driver/api.py) both write through `save_samples`, so `run.sample(...).save(OUT)` writes
the file the command writes.

    image testbeds     a PNG grid: one row per prompt (labelled with its class or text), its K samples across
    language models    a text file: each prompt, then its K completions

`--prompts` is a prompts file (`.txt`: one a line, `#` comments; `.jsonl`: a "prompt" field a line, as
text-to-image prompt sets are written) or one prompt's literal text; the testbed turns the texts into its prompt
ids (`Testbed.prompts_from_text`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from steadyrl.services.testbeds.base import PromptError

if TYPE_CHECKING:
    from steadyrl.services.driver.api import Samples

PROMPT_FILES = (".txt", ".jsonl")
IMAGE_SUFFIX, TEXT_SUFFIX = ".png", ".txt"
SUFFIXES = (IMAGE_SUFFIX, TEXT_SUFFIX)


def read_prompts(source: str | Path) -> list[str]:
    """The prompts of `source`: a `.txt` / `.jsonl` prompts file, or else one prompt's literal text. A
    `PromptError` names a prompts file that is missing, unreadable, malformed or empty."""
    from steadyrl.rollout.prompts import load_prompt_set

    text = str(source)
    path = Path(text).expanduser()
    looks_like_a_file = path.suffix.lower() in PROMPT_FILES and "\n" not in text
    if not looks_like_a_file:
        if path.is_dir():
            raise PromptError(f"--prompts {text}: a folder; give a .txt or .jsonl prompts file, or a prompt's text")
        if not text.strip():
            raise PromptError("--prompts: an empty prompt")
        return [text]
    if not path.is_file():
        raise PromptError(f"--prompts {text}: no such prompts file")
    try:
        return list(load_prompt_set(path).prompts)
    except (OSError, UnicodeDecodeError) as err:
        raise PromptError(f"--prompts {text}: cannot read the prompts file ({err})") from None
    except ValueError as err:  # a malformed line (named with its number), or no prompts
        raise PromptError(f"--prompts {text}: {err}") from None


def output_file(samples: "Samples", out: str | Path) -> Path:
    """The file `out` names: itself when it ends in the samples' suffix (.png for images, .txt for texts), or
    `samples_step_N.<suffix>` in the folder `out` (made if missing). A `ValueError` names a wrong suffix."""
    out = Path(out)
    suffix = IMAGE_SUFFIX if samples.images is not None else TEXT_SUFFIX
    if out.is_dir() or (not out.suffix and not out.exists()):
        return out / f"samples_step_{samples.step}{suffix}"
    if out.suffix.lower() != suffix:
        what = "images" if samples.images is not None else "texts"
        raise ValueError(f"{out}: these samples are {what}, written as a {suffix} file (or give a folder)")
    return out


def save_samples(samples: "Samples", out: str | Path) -> Path:
    """`samples` written to `out` (`output_file`): the PNG grid or the text file; returns the file. It is written
    beside its place and renamed into it, so an error leaves no half-written file."""
    path = output_file(samples, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}{path.suffix}"
    try:
        if samples.images is not None:
            save_grid(samples, tmp)
        else:
            tmp.write_text(samples_text(samples))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _rows(samples: "Samples") -> list[int]:
    """The first sample of each prompt's row (samples are prompt-major, `per_prompt` each)."""
    return list(range(0, len(samples), samples.per_prompt))


def save_grid(samples: "Samples", path: Path) -> None:
    """The images in a grid: a row per prompt (its K samples across), labelled with the class or prompt text."""
    from steadyrl.services.run_folder.figures import save_sample_grid

    k, images = samples.per_prompt, samples.images
    grid = images.reshape(len(images) // k, k, *images.shape[1:])
    save_sample_grid(grid, path, samples.title, labels=[str(samples.prompts[i]) for i in _rows(samples)])


def samples_text(samples: "Samples") -> str:
    """A header line (`# ...`), then per prompt: the prompt, its completions each on a line `  [j] ...` (a line
    break inside one continues indented), and a blank line."""
    def indented(text: str, first: str, rest: str) -> list[str]:
        lines = str(text).split("\n")
        return [first + lines[0], *(rest + line for line in lines[1:])]

    out = [f"# {samples.title}", ""]
    for i in _rows(samples):
        out += indented(samples.prompts[i], "", "")
        for j in range(samples.per_prompt):
            tag = f"  [{j + 1}] "
            out += indented(samples.texts[i + j], tag, " " * len(tag))
        out.append("")
    return "\n".join(out)
