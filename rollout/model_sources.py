"""Can the models a config names be had? Checked before anything starts.

A model source (`testbed.pretrained`, a reward model's `model`) is a local directory or a hub id. Loading one that
is neither on disk nor in the local Hugging Face cache (steadyrl runs offline by default, HF_HUB_OFFLINE=1) fails
deep inside diffusers or transformers, after Ray started and the run folder was made, with a long traceback.
`check_model_sources` finds every such source up front and raises one error that names each setting and says how
to provide it. It reads the hub's own settings (`huggingface_hub.constants`: HF_HUB_OFFLINE, HF_HUB_CACHE,
HF_ENDPOINT), so it agrees with the loaders that come after it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

#: seconds to wait for the hub when online and a source is not cached (the loaders then download it)
PROBE_TIMEOUT_S = 10.0
_PATH_PREFIXES = ("/", "./", "../", "~")


class ModelsUnavailable(ValueError):
    """Model sources that cannot be had: `problems` holds (setting, source, why) of each; the message says all."""

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = problems
        super().__init__(unavailable_message(problems))


def check_model_sources(sources: Sequence[tuple[str, str]]) -> None:
    """Raise `ModelsUnavailable` naming every (setting, name-or-path) of `sources` that cannot be loaded."""
    seen: dict[str, str | None] = {}  # a source named twice (a model and its processor) is looked up once
    problems = []
    for setting, source in sources:
        if source not in seen:
            seen[source] = source_problem(source)
        if seen[source] is not None:
            problems.append((setting, source, seen[source]))
    if problems:
        raise ModelsUnavailable(problems)


def source_problem(source: str) -> str | None:
    """Why `source` cannot be loaded (None: it can). An existing directory is used as it is (as the loaders do,
    before they consider the hub); a path that does not exist is an error; anything else is a hub id."""
    if not source.strip():
        return "is empty (a directory or a hub id is needed)"
    path = Path(source).expanduser()
    if path.is_dir():
        return None
    if path.exists():
        return "is a file, not a model directory"
    if source.startswith(_PATH_PREFIXES):
        return "no such directory"
    return hub_problem(source)


def hub_problem(repo_id: str) -> str | None:
    """Why hub id `repo_id` cannot be loaded (None: it is in the local cache or, online, the hub serves it)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, local_files_only=True)
        return None
    except HFValidationError:
        return "no such directory, and not a hub id (namespace/name)"
    except LocalEntryNotFoundError as err:
        if getattr(err, "snapshot_path", None):  # cached, though not every file of the repo: the loader decides
            return None
    if constants.HF_HUB_OFFLINE:
        return "not in the local Hugging Face cache, and no such directory"
    return _probe_hub(repo_id, constants.ENDPOINT)


def _probe_hub(repo_id: str, endpoint: str) -> str | None:
    """Ask the hub whether it would serve `repo_id` to this user (a gated model: whether its licence was
    accepted); the reason's first line where not."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    api = HfApi()
    try:
        info = api.model_info(repo_id, timeout=PROBE_TIMEOUT_S)
        if getattr(info, "gated", False) and hasattr(api, "auth_check"):  # huggingface_hub >= 0.24
            api.auth_check(repo_id)
        return None
    except GatedRepoError:
        return "gated, and this user has no access: accept its licence on the hub, then `hf auth login`"
    except RepositoryNotFoundError:
        return f"no such model on the hub ({endpoint}), nor a local directory (or the model is private)"
    except Exception as err:  # connection refused, timeouts, proxies: whatever stops the download later
        reason = next(iter(str(err).strip().splitlines()), "")
        return (f"not in the local Hugging Face cache, and the hub ({endpoint}) cannot be asked: "
                f"{type(err).__name__}: {reason}")


def unavailable_message(problems: list[tuple[str, str, str]]) -> str:
    """One line per source (setting, id, why), then how to provide them."""
    from huggingface_hub import constants

    one = len(problems) == 1
    lines = [f"{'a model' if one else f'{len(problems)} models'} cannot be loaded:"]
    lines += [f"  {setting}={source!r}: {why}" for setting, source, why in problems]
    lines.append(f"Provide {'it' if one else 'each'} as a local directory (e.g. {problems[0][0]}=/path/to/local/copy) "
                 f"or download it into the cache ({constants.HF_HUB_CACHE}): `hf download ID` (older huggingface_hub: "
                 "`huggingface-cli download ID`); a gated model: accept its licence on the hub and `hf auth login` "
                 "(`huggingface-cli login`) first.")
    if constants.HF_HUB_OFFLINE:
        lines.append("steadyrl runs offline by default (HF_HUB_OFFLINE=1): set HF_HUB_OFFLINE=0 to let it download.")
    return "\n".join(lines)
