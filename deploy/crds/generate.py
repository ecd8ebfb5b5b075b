"""Vendor the KubeRay CRDs' structural schemas: fields, types, enums, formats, patterns and required lists,
with KubeRay's description texts stripped where present (they carry no validation), as compact JSON.

    python deploy/crds/generate.py [CRD_DIR]      # default CRD_DIR: ../shared/kuberay-crds (KubeRay v1.7)

writes deploy/crds/<kind>.schema.json for RayJob, RayCluster and RayService: each served version's
openAPIV3Schema, with the CRD's group and kind, so tests/test_deploy_manifests.py validates the manifests
on any clone. Re-run it when KubeRay is upgraded; the test checks the vendored files against the CRDs
whenever the CRD folder is present.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_SOURCE = HERE.parents[2] / "shared" / "kuberay-crds"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml",
             "RayService": "ray.io_rayservices.yaml"}
KUBERAY_VERSION = "v1.7"
SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf")


def structural(node: Any) -> Any:
    """A schema node without `description` (only the keyword: a property named "description" stays)."""
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "description":
            continue
        if key == "properties":
            out[key] = {name: structural(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = structural(value)
        elif key in SUBSCHEMA_LISTS:
            out[key] = [structural(sub) for sub in value]
        else:
            out[key] = value
    return out


def vendored(crd: dict[str, Any], source: str) -> dict[str, Any]:
    """The parts of a CRD the manifest tests read."""
    spec = crd["spec"]
    return {
        "kind": spec["names"]["kind"], "group": spec["group"], "kuberay": KUBERAY_VERSION, "source": source,
        "licence": "Apache-2.0 (KubeRay, github.com/ray-project/kuberay); descriptions stripped",
        "versions": {v["name"]: {"served": v.get("served", False), "storage": v.get("storage", False),
                                 "openAPIV3Schema": structural(v["schema"]["openAPIV3Schema"])}
                     for v in spec["versions"]},
    }


def schema_path(kind: str) -> Path:
    return HERE / f"{kind.lower()}.schema.json"


def render(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n"


def main(source: Path = DEFAULT_SOURCE) -> None:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for kind, name in CRD_FILES.items():
        with (source / name).open() as f:
            crd = yaml.load(f, Loader=loader)
        text = render(vendored(crd, name))
        schema_path(kind).write_text(text)
        print(f"{schema_path(kind).name}: {len(text) / 1e3:.0f} kB (from {(source / name).stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SOURCE)
