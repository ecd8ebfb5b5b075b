"""`make gpu-wheels`: the wheel folder for an air-gapped GPU node (CPython 3.12, torch and a few packages, no index)
holds what steadyrl's local runtime lacks there and nothing the node has, pinned to this venv's versions and within
the size limit; the node's standard-library check names a missing or altered wheel; a set over the limit or a
package that cannot be had fails in one paragraph with exit status 2 and writes nothing.

One cp312 set is built from the index (pip's cache makes reruns fast); the failure cases then run without the index
on that set's wheels as find-links, so they take seconds and name exactly what is left out."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_wheels.py"
MIB = 1024 * 1024


def gpu_wheels(*args: str, find_links: Path | None = None) -> subprocess.CompletedProcess:
    """The script as `make gpu-wheels` runs it; with `find_links`, offline on that folder's wheels alone."""
    env = dict(os.environ)
    if find_links is not None:
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(find_links))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=900)


def check(folder: Path) -> subprocess.CompletedProcess:
    """The node's check: -I -S, so neither steadyrl nor packaging (nor anything but the standard library) imports."""
    return subprocess.run([sys.executable, "-I", "-S", str(SCRIPT), "--check", str(folder)], capture_output=True,
                          text=True, timeout=120)


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def assert_failed_cleanly(done: subprocess.CompletedProcess, *named: str) -> None:
    """Exit status 2 and one paragraph naming each of `named`, no traceback."""
    err = done.stderr.strip()
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and err.startswith("gpu-wheels: error:") and "\n" not in err, err
    for name in named:
        assert name in err, (name, err)


def wheel_file(folder: Path, name: str) -> Path:
    return folder / next(w["file"] for w in manifest(folder)["wheels"] if w["name"] == name)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "wheels"
    done = gpu_wheels("--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_cp312_set_holds_what_the_node_lacks_and_nothing_it_has_within_the_limit(built):
    m = manifest(built)
    wheels = {w["name"]: w for w in m["wheels"]}
    assert {"diffusers", "deepspeed", "pydantic", "pydantic-core", "math-verify", "steadyrl"} <= wheels.keys()
    # serving only (ray, fastapi), the node's own packages and what they need (numpy, huggingface-hub)
    assert not {"ray", "fastapi", "torch", "transformers", "peft", "numpy", "huggingface-hub"} & wheels.keys()
    assert re.search(r"-cp312-cp312-manylinux.*_x86_64\.whl$", wheels["pydantic-core"]["file"])
    assert wheels["deepspeed"]["file"].endswith("-py3-none-any.whl")  # built here from the sdist, ops JIT on the node
    for name, w in wheels.items():  # what CI tested
        if name != "steadyrl":
            assert Version(w["version"]) == Version(metadata.version(name)), name
    on_disk = sum(p.stat().st_size for p in built.glob("*.whl"))
    assert m["python"] == "3.12" and m["abi"] == "cp312" and "manylinux_2_28_x86_64" in m["platforms"]
    assert on_disk == m["total_bytes"] <= 64 * MIB and m["limit_mib"] == 64
    assert "torch" in m["node_has"] and len(list(built.glob("*.whl"))) == len(wheels)
    done = check(built)
    assert done.returncode == 0 and f"{len(wheels)} wheels" in done.stdout, done.stdout + done.stderr
    assert [p.name for p in built.parent.iterdir()] == ["wheels"]  # no partial folder left beside it


@pytest.mark.parametrize("damage", ["missing", "altered", "extra"])
def test_the_check_names_a_missing_altered_or_extra_wheel(built, tmp_path, damage):
    folder = tmp_path / "copy"
    shutil.copytree(built, folder)
    assert check(folder).returncode == 0
    if damage == "missing":
        victim = wheel_file(folder, "pydantic-core")
        victim.unlink()
        named = (victim.name, "missing", "pydantic-core")
    elif damage == "altered":
        victim = wheel_file(folder, "deepspeed")
        data = bytearray(victim.read_bytes())
        data[-1] ^= 1  # same size, other sha256
        victim.write_bytes(bytes(data))
        named = (victim.name, "differs")
    else:
        shutil.copy(wheel_file(folder, "zipp"), folder / "stray-1.0-py3-none-any.whl")
        named = ("stray-1.0-py3-none-any.whl", "not in the manifest")
    assert_failed_cleanly(check(folder), *named)
    if damage == "missing":  # and through the make target the node's smoke script mirrors
        done = subprocess.run(["make", "--no-print-directory", "gpu-wheels-check", f"GPU_WHEELS={folder}"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert done.returncode != 0 and victim.name in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_set_over_the_limit_fails_naming_total_and_limit_and_leaves_an_existing_folder_untouched(built, tmp_path):
    out = tmp_path / "wheels"
    out.mkdir()
    (out / "manifest.json").write_text("the good folder of an earlier run\n")
    done = gpu_wheels("--out", str(out), "--limit-mib", "1", find_links=built)
    assert_failed_cleanly(done, "over the limit of 1 MiB", "GPU_NODE_HAS", "scipy")
    total = int(re.search(r"is [\d.]+ MiB \((\d+) bytes\)", done.stderr)[1])
    assert abs(total - manifest(built)["total_bytes"]) < MIB  # the same set (steadyrl rebuilt from the checkout)
    assert done.stderr.index("scipy") < done.stderr.index("scikit-learn")  # largest first
    assert [p.name for p in out.iterdir()] == ["manifest.json"]
    assert (out / "manifest.json").read_text() == "the good folder of an earlier run\n"
    assert [p.name for p in tmp_path.iterdir()] == ["wheels"]


def test_a_package_that_cannot_be_had_fails_naming_it_and_leaves_no_folder(built, tmp_path):
    links = tmp_path / "links"  # the set's wheels without math-verify's: nowhere else to get it from
    shutil.copytree(built, links, ignore=shutil.ignore_patterns("math_verify-*"))
    out = tmp_path / "wheels"
    done = gpu_wheels("--out", str(out), find_links=links)
    assert_failed_cleanly(done, f"math-verify {metadata.version('math-verify')}", "cp312", "manylinux")
    assert "scipy" not in done.stderr and "diffusers" not in done.stderr  # only what is missing is named
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["links"]
