"""Data files the package ships (prompt sets, task files) and user paths, resolved one way.

A bare word (no directory part, no extension) names a shipped file by its stem; anything else is a path,
which must exist and have one of the kind's suffixes.
"""
from __future__ import annotations

from pathlib import Path


def shipped_files(directory: Path, suffixes: tuple[str, ...]) -> dict[str, Path]:
    """The files in `directory` with one of `suffixes`, by stem."""
    if not directory.is_dir():
        return {}
    return {p.stem: p for p in sorted(directory.iterdir()) if p.is_file() and p.suffix in suffixes}


def is_shipped_name(source: str | Path) -> bool:
    """A bare word names a shipped file; anything else is a path."""
    return isinstance(source, str) and Path(source).name == source and Path(source).suffix == ""


def resolve_data_file(source: str | Path, directory: Path, suffixes: tuple[str, ...], what: str) -> Path:
    """The path of a shipped name or a user path; clear errors naming `what` ("prompt set", "task file")."""
    if is_shipped_name(source):
        shipped = shipped_files(directory, suffixes)
        if source not in shipped:
            raise ValueError(f"unknown {what} {source!r}: the shipped ones are {', '.join(shipped) or 'none'} "
                             f"(or give a path to a {' or '.join(suffixes)} file)")
        return shipped[source]
    path = Path(source)
    if path.suffix.lower() not in suffixes:
        raise ValueError(f"{what} {path}: unsupported extension {path.suffix or '(none)'!r}; "
                         f"supported: {', '.join(suffixes)}")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    return path
