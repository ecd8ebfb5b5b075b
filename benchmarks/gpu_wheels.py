"""Fill a wheel folder for an air-gapped GPU node, and check such a folder against its manifest.

    python benchmarks/gpu_wheels.py [--out .gpu-wheels] [--python 3.12] [--limit-mib 64] [--node-has torch ...]
    python benchmarks/gpu_wheels.py --check .gpu-wheels      # standard library only: runs on the node itself

The node has torch (CUDA) and a few packages but no index: what steadyrl's local runtime needs beyond them travels
with the checkout as wheels. The set is the closure of pyproject's `dependencies` without `ray` and `fastapi` (only
the Ray runtime and services/serving import them), minus the closure of what the node has (--node-has; --node-lacks
names what never counts as there, though this venv's versions of those packages require it); both are read from
this venv's installed metadata with markers evaluated for the target (CPython X.Y on manylinux x86_64), and each
package is pinned to the version installed here, so the node runs what CI tested. Each is downloaded as a wheel for the
target; one with only an sdist (DeepSpeed) is built here as a pure-python wheel (its CUDA ops compile just in
time on the node). steadyrl itself is built from the checkout. Checks that fail print one paragraph and exit 2,
and nothing is written to the output folder: the set is built in a temporary folder beside it and renamed into
place at the end, so an existing folder is replaced only by a complete one.

The module imports only the standard library at top level: the node checks a folder with a bare Python 3.12.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "manifest.json"
MIB = 1024 * 1024
#: only the Ray runtime and services/serving import these: `steadyrl train --local` runs without them
SERVING_ONLY = ("ray", "fastapi")
#: what the GPU node has installed (with whatever they depend on): left out with their closure
NODE_HAS = ("torch", "transformers", "peft", "accelerate", "safetensors", "rich", "typer", "matplotlib", "tensorboard")
#: what the node is known to lack although this venv's versions of NODE_HAS may require it (typer 0.29 here
#: requires pydantic; the node's typer does not): never counted as present
NODE_LACKS = ("ray", "diffusers", "deepspeed", "pydantic", "fastapi", "math-verify")
#: newest glibc the node is assumed to have (manylinux_2_28: RHEL 8, Ubuntu 20.04 and later); older tags match too
GLIBC_MINOR = 28
DOWNLOADS = 6  # pip processes at once: mostly waiting on the index
NO_MATCH = "No matching distribution found"  # pip's words for a package none of its indexes has


class WheelError(Exception):
    """A check that failed: printed as one paragraph, exit status 2."""


class Unavailable(WheelError):
    """No wheel and no sdist of a pinned package: reported together, as one list of names."""

    def __init__(self, what: str, reason: str):
        super().__init__(f"{what}: {reason}")
        self.what, self.reason = what, reason


@dataclass(frozen=True)
class Target:
    """The interpreter and platform the wheels are for: CPython `python` on manylinux x86_64."""

    python: str  # "3.12"

    @property
    def abi(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def platforms(self) -> list[str]:
        """Every manylinux tag up to GLIBC_MINOR: pip does not expand manylinux_2_28 to the older ones itself."""
        tags = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 4, -1)]
        return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]

    def describe(self) -> str:
        return f"CPython {self.python} ({self.abi}) on manylinux x86_64 (glibc <= 2.{GLIBC_MINOR}) or pure-python"

    def pip_args(self) -> list[str]:
        """pip's flags for wheels that install on the target (pure-python ones match too)."""
        plats = [arg for plat in self.platforms for arg in ("--platform", plat)]
        return ["--only-binary=:all:", "--python-version", self.python, "--implementation", "cp", "--abi", self.abi, *plats]

    def marker_env(self) -> dict[str, str]:
        """PEP 508 marker values on the target, so a dependency of 3.12 or Linux only is seen from this venv."""
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        full = platform.python_version() if here == self.python else f"{self.python}.0"
        return {"python_version": self.python, "python_full_version": full, "implementation_version": full,
                "implementation_name": "cpython", "platform_python_implementation": "CPython",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                "os_name": "posix", "platform_release": "", "platform_version": "", "extra": ""}

    def accepts(self, wheel: str) -> bool:
        """Whether a wheel file installs on the target (checked on what was built here, and on every download)."""
        from packaging import tags
        from packaging.utils import parse_wheel_filename

        version = tuple(int(x) for x in self.python.split("."))
        ok = {*tags.cpython_tags(version, [self.abi], self.platforms),
              *tags.compatible_tags(version, self.abi, self.platforms)}
        return not ok.isdisjoint(parse_wheel_filename(wheel)[3])


@dataclass(frozen=True)
class Pin:
    """One distribution of the set at the version this venv has."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


# ---------------------------------------------------------------- resolving the set from this venv's metadata


def runtime_requirements() -> list[str]:
    """pyproject's `dependencies` without what only the Ray runtime and serving import."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if canonicalize_name(Requirement(d).name) not in SERVING_ONLY]


def closure(roots: Iterable[str], env: dict[str, str], stop: Iterable[str] = ()) -> dict[str, str]:
    """Every distribution `roots` need on the target, each mapped to one that requires it ("" for a root).

    Extras are followed (`ray[serve]` needs what `serve` adds); names in `stop` and distributions this venv
    lacks are kept but not expanded."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    stop = {canonicalize_name(n) for n in stop}
    found: dict[str, str] = {}
    todo = [(Requirement(r), "") for r in roots]
    done: set[tuple[str, str]] = set()
    while todo:
        req, parent = todo.pop()
        name = canonicalize_name(req.name)
        found.setdefault(name, parent)
        for extra in ("", *req.extras):
            if (name, extra) in done or name in stop:
                continue
            done.add((name, extra))
            try:
                requires = metadata.requires(name) or []
            except metadata.PackageNotFoundError:
                continue
            for sub in map(Requirement, requires):
                if sub.marker is None or sub.marker.evaluate({**env, "extra": extra}):
                    todo.append((sub, name))
    return found


def resolve(target: Target, node_has: list[str], node_lacks: list[str]) -> tuple[list[Pin], list[str]]:
    """The pinned set the node lacks, and notes on what NODE_LACKS kept in it."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    env = target.marker_env()
    lacks = {canonicalize_name(n) for n in node_lacks} - {canonicalize_name(n) for n in node_has}
    needed = closure(runtime_requirements(), env)
    present = set(closure(node_has, env, stop=lacks)) - lacks
    notes = [f"{name} is required here by {by} (of GPU_NODE_HAS) but the node lacks it: shipped"
             for name, by in closure(node_has, env).items() if name in lacks and name in needed]
    pins, missing = [], []
    for name in sorted(set(needed) - present):
        try:
            pins.append(Pin(name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            missing.append(f"{name} (required by {needed[name] or 'steadyrl'})")
    if missing:
        raise WheelError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} needed on {target.describe()} "
                         "but not installed in this venv, so there is no tested version to pin: run `make install` "
                         "with a Python whose markers match, or add them to GPU_NODE_HAS if the node has them.")
    return pins, notes


# ---------------------------------------------------------------- fetching and building the wheels


def pip(*args: str) -> subprocess.CompletedProcess:
    """This venv's pip, its output kept for the error message."""
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--progress-bar", "off"]
    return subprocess.run(cmd, capture_output=True, text=True)


def pip_error(done: subprocess.CompletedProcess) -> str:
    """pip's own reason in one line: its first ERROR line, else its last line."""
    lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or [f"exit status {done.returncode}"])[0].removeprefix("ERROR: ")


def only_file(folder: Path, what: str) -> Path:
    """The single file pip left in `folder`."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if len(files) != 1:
        raise WheelError(f"{what}: pip left {len(files)} files in {folder} instead of one")
    return files[0]


def fetch(pin: Pin, target: Target, work: Path) -> Path:
    """The target's wheel of `pin` from the index, or else one built here from its sdist.

    The build runs in this venv (--no-build-isolation): DeepSpeed's setup imports torch, and with DS_BUILD_OPS=0
    (its default) leaves its CUDA ops to compile just in time on the node, so its wheel is pure-python. pip
    caches the built wheel: a rerun does not build again."""
    got = pip("download", "--no-deps", *target.pip_args(), "--dest", str(work), str(pin))
    if got.returncode == 0:
        return only_file(work, str(pin))
    source = ["wheel", "--no-deps", "--no-build-isolation", "--no-binary=:all:", str(pin)]
    built = pip(*source, "--wheel-dir", str(work))
    if built.returncode != 0 and NO_MATCH in built.stderr:
        raise Unavailable(f"{pin.name} {pin.version}", pip_error(got))
    if built.returncode != 0:
        raise WheelError(f"{pin.name} {pin.version} has no wheel for the target and building one from its sdist "
                         f"failed ({pip_error(built)}; `pip {' '.join(source)}` in this venv shows why)")
    wheel = only_file(work, str(pin))
    if not target.accepts(wheel.name):
        raise WheelError(f"{pin.name} {pin.version} has no wheel for the target, and the one built here from its "
                         f"sdist, {wheel.name}, is neither pure-python nor for the target")
    return wheel


def source_copy(dest: Path) -> Path:
    """What steadyrl's wheel is built from: pyproject, the readme and the package folders it names, copied, since
    an in-tree build leaves build/ in the checkout and ships whatever stale files an earlier one left there."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = sorted(set(project["tool"]["setuptools"]["package-dir"].values()))
    for folder in [f for f in folders if not any(f.startswith(g + "/") for g in folders)]:  # services/api: in services
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", project["project"]["readme"]):
        shutil.copy2(ROOT / name, dest / name)
    return dest


def build_self(work: Path) -> Path:
    """steadyrl's wheel from the checkout; without build isolation, so it needs no index (this venv's setuptools,
    which torch already requires at >=77, builds it)."""
    src = source_copy(work / "src")
    built = pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(work / "wheel"), str(src))
    if built.returncode != 0:
        raise WheelError(f"steadyrl: building its wheel from {ROOT} failed ({pip_error(built)})")
    return only_file(work / "wheel", "steadyrl")


def fetch_all(pins: list[Pin], target: Target, staging: Path) -> list[Path]:
    """Every wheel of the set in `staging`; all failures reported together, each naming its package."""
    jobs: list[Callable[[Path], Path]] = [lambda work, p=p: fetch(p, target, work) for p in pins]
    jobs.append(build_self)

    def run(i: int) -> Path | WheelError:
        work = staging / ".work" / str(i)
        work.mkdir(parents=True)
        try:
            wheel = jobs[i](work)
        except WheelError as e:
            return e
        if not target.accepts(wheel.name):
            return WheelError(f"{wheel.name} does not install on the target")
        return wheel.rename(staging / wheel.name)

    with ThreadPoolExecutor(DOWNLOADS) as pool:
        results = list(pool.map(run, range(len(jobs))))
    shutil.rmtree(staging / ".work")
    unavailable = [r for r in results if isinstance(r, Unavailable)]
    failed = [str(r) for r in results if isinstance(r, WheelError) and r not in unavailable]
    if unavailable:
        more = f", and so on for the other {len(unavailable) - 1}" if len(unavailable) > 1 else ""
        failed.insert(0, f"no usable wheel for {target.describe()}, and none could be built from an sdist, on "
                         f"pip's indexes and find-links for {', '.join(u.what for u in unavailable)} (pip: {unavailable[0].reason}{more})")
    if failed:
        raise WheelError("; ".join(failed) + ". Nothing was written.")
    return [r for r in results if isinstance(r, Path)]


# ---------------------------------------------------------------- the manifest and its checks (standard library)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_entry(path: Path) -> dict:
    """A manifest row: the distribution and version as the wheel's file name spells them (PEP 427)."""
    name, version = path.name.split("-")[:2]
    return {"name": name.replace("_", "-").lower(), "version": version, "file": path.name,
            "bytes": path.stat().st_size, "sha256": sha256(path)}


def mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB"


def check_limit(entries: list[dict], limit_mib: float) -> None:
    """The set must fit what the checkout may carry; the largest wheels are where to look."""
    total = sum(e["bytes"] for e in entries)
    if total <= limit_mib * MIB:
        return
    largest = sorted(entries, key=lambda e: -e["bytes"])[:8]
    raise WheelError(f"the wheel set is {mib(total)} ({total} bytes), over the limit of {limit_mib:g} MiB "
                     f"(GPU_WHEEL_LIMIT_MIB). Largest first: "
                     + ", ".join(f"{e['name']} {e['version']} {mib(e['bytes'])}" for e in largest)
                     + ". Add packages the GPU node already has to GPU_NODE_HAS (they and what they need are "
                       "left out), or raise the limit. Nothing was written.")


def write_manifest(folder: Path, target: Target, limit_mib: float, node: dict[str, list[str]],
                   entries: list[dict]) -> dict:
    """manifest.json: what the set is for and, per wheel, what `--check` compares on the node."""
    manifest = {"python": target.python, "implementation": "cp", "abi": target.abi, "platforms": target.platforms,
                "limit_mib": limit_mib, "total_bytes": sum(e["bytes"] for e in entries), **node,
                "wheels": sorted(entries, key=lambda e: e["name"])}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        manifest, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "without wheels, limit_mib, total_bytes, or a wheel's name, version, file, bytes and sha256"
    row = {"name", "version", "file", "bytes", "sha256"}
    if not (isinstance(manifest, dict) and {"wheels", "limit_mib", "total_bytes"} <= manifest.keys()
            and all(isinstance(e, dict) and row <= e.keys() for e in manifest["wheels"])):
        raise WheelError(f"{folder} has no usable {MANIFEST} ({why}): it was not made by `make gpu-wheels`, "
                         "or not completely.")
    return manifest


def check_folder(folder: Path) -> dict:
    """The folder holds exactly the manifest's wheels, each of its size and sha256, within the manifest's limit."""
    manifest = read_manifest(folder)
    problems, listed = [], {e["file"] for e in manifest["wheels"]}
    for e in manifest["wheels"]:
        path = folder / e["file"]
        if not path.is_file():
            problems.append(f"{e['file']} ({e['name']} {e['version']}) is missing")
        elif path.stat().st_size != e["bytes"] or sha256(path) != e["sha256"]:
            problems.append(f"{e['file']} differs from the manifest (size or sha256)")
    problems += [f"{p.name} is not in the manifest" for p in sorted(folder.glob("*.whl")) if p.name not in listed]
    total = sum(e["bytes"] for e in manifest["wheels"])
    if total != manifest["total_bytes"]:
        problems.append(f"the wheels add up to {total} bytes, the manifest says {manifest['total_bytes']}")
    if total > manifest["limit_mib"] * MIB:
        problems.append(f"the set is {mib(total)}, over its limit of {manifest['limit_mib']:g} MiB")
    if problems:
        raise WheelError(f"{folder} does not match its {MANIFEST}: " + "; ".join(problems)
                         + ". Rebuild it with `make gpu-wheels` (or copy it again) before installing from it.")
    return manifest


# ---------------------------------------------------------------- building the folder


def print_set(entries: list[dict], limit_mib: float) -> None:
    """The set as written: what the node will install, and what each wheel weighs."""
    for e in entries:
        print(f"  {e['name']:<28} {e['version']:<18} {mib(e['bytes']):>10}  {e['file']}")
    print(f"  {len(entries)} wheels, {mib(sum(e['bytes'] for e in entries))} (limit {limit_mib:g} MiB)")


def build(out: Path, target: Target, limit_mib: float, node_has: list[str], node_lacks: list[str]) -> dict:
    """Resolve, fetch and check the set in a folder beside `out`, then rename it into place."""
    pins, notes = resolve(target, node_has, node_lacks)
    print(f"{len(pins)} packages for {target.describe()}, besides the node's {' '.join(node_has)}:")
    print("  " + " ".join(map(str, pins)) + " + steadyrl (this checkout)")
    for note in notes:
        print(f"  note: {note}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would stay on the renamed folder
    try:
        wheels = fetch_all(pins, target, staging)
        entries = [wheel_entry(w) for w in wheels]
        check_limit(entries, limit_mib)
        manifest = write_manifest(staging, target, limit_mib, {"node_has": node_has, "node_lacks": node_lacks},
                                  entries)
        check_folder(staging)
        replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print_set(manifest["wheels"], limit_mib)
    print(f"wrote {out} ({MANIFEST}); check it with: python3 benchmarks/gpu_wheels.py --check {out}")
    return manifest


def replace(staging: Path, out: Path) -> None:
    """Put the complete folder at `out`; an older one is removed only once the new one is in place."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / out.name)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old)


def names(values: list[str]) -> list[str]:
    """Names given as separate arguments or as one space- or comma-separated string (a make variable)."""
    return [n for v in values for n in v.replace(",", " ").split()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", metavar="DIR", type=Path, help="only check DIR against its manifest (stdlib only)")
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu-wheels")
    ap.add_argument("--python", default="3.12", help="the node's Python, X.Y (default 3.12)")
    ap.add_argument("--limit-mib", type=float, default=64.0)
    ap.add_argument("--node-has", nargs="*", default=list(NODE_HAS), help="what the node has installed")
    ap.add_argument("--node-lacks", nargs="*", default=list(NODE_LACKS),
                    help="what the node lacks even where this venv's NODE_HAS would pull it in")
    args = ap.parse_args(argv)
    try:
        if args.check is not None:
            m = check_folder(args.check)
            print(f"{args.check}: {len(m['wheels'])} wheels, {mib(m['total_bytes'])} (limit {m['limit_mib']:g} MiB), "
                  f"for {m.get('abi', '?')} manylinux x86_64: every wheel present and unaltered")
        else:
            if not re.fullmatch(r"3\.\d+", args.python):
                raise WheelError(f"--python {args.python}: give the node's Python as X.Y, e.g. 3.12")
            build(args.out, Target(args.python), args.limit_mib, names(args.node_has), names(args.node_lacks))
    except WheelError as e:
        print(f"gpu-wheels: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
