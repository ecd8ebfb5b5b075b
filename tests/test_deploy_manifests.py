"""Schema checks for the KubeRay manifests in deploy/.

Every document in deploy/*.yaml is validated against the openAPIV3Schema of the
KubeRay v1.7 CRD chosen by its kind and apiVersion, vendored in deploy/crds/ as
structural schemas (deploy/crds/generate.py writes them from the CRD files; a test
checks them against ../shared/kuberay-crds/ where that folder exists). No cluster
and no Docker engine is needed.

The check follows what the API server does with `kubectl apply` (strict field
validation, the kubectl default since Kubernetes 1.27): besides types, enums and
patterns, a field the schema does not declare is an error, unless the object is
marked x-kubernetes-preserve-unknown-fields. CEL rules (x-kubernetes-validations)
are not evaluated.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml


REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
CRD_DIR = Path(__file__).resolve().parents[2] / "shared" / "kuberay-crds"  # the CRDs the vendored schemas come from
VENDORED = DEPLOY / "crds"
KINDS = ("RayJob", "RayCluster", "RayService")
DIGITS_JOB = DEPLOY / "rayjob-digits.yaml"

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD files are ~1 MB each


def _manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")) + sorted(DEPLOY.glob("*.yml")):
        with path.open() as f:
            for i, doc in enumerate(yaml.load_all(f, Loader=Loader)):
                if doc is not None:
                    docs.append((f"{path.name}#{i}", doc))
    return docs


MANIFESTS = _manifests()


def _strict(node):
    """Copy of a CRD schema in which undeclared fields are errors, as under
    kubectl's strict field validation. int-or-string fields without a type
    (jsonschema would accept anything there) get the integer|string type."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") and "type" not in node and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


@functools.lru_cache(maxsize=None)
def _crd(kind: str) -> dict:
    """The vendored structural schema of `kind` (deploy/crds/<kind>.schema.json)."""
    assert kind in KINDS, f"no KubeRay CRD known for kind {kind!r}; deploy/ manifests must be one of {sorted(KINDS)}"
    return json.loads((VENDORED / f"{kind.lower()}.schema.json").read_text())


@functools.lru_cache(maxsize=None)
def _validator(kind: str, api_version: str):
    crd = _crd(kind)
    group, _, version = api_version.partition("/")
    assert crd["kind"] == kind
    assert group == crd["group"], f"apiVersion {api_version!r}: group is not {crd['group']!r}"
    versions = crd["versions"]
    assert version in versions, f"apiVersion {api_version!r}: CRD {kind} serves {sorted(versions)}"
    assert versions[version]["served"], f"{kind} {version} is not served"
    schema = _strict(versions[version]["openAPIV3Schema"])
    cls = jsonschema.Draft7Validator
    cls.check_schema(schema)
    return cls(schema)


def _errors(doc: dict) -> list[str]:
    validator = _validator(doc.get("kind"), doc.get("apiVersion", ""))
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def _load_digits_job() -> dict:
    with DIGITS_JOB.open() as f:
        return yaml.load(f, Loader=Loader)


def test_deploy_has_manifests():
    names = {name.split("#")[0] for name, _ in MANIFESTS}
    assert DIGITS_JOB.name in names


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=[n for n, _ in MANIFESTS])
def test_manifest_matches_crd_schema(name, doc):
    assert isinstance(doc, dict) and {"apiVersion", "kind", "metadata", "spec"} <= doc.keys(), name
    errors = _errors(doc)
    assert not errors, f"{name} fails the {doc['kind']} CRD schema:\n" + "\n".join(errors)


@pytest.mark.parametrize(
    "mutate,expected",
    [
        pytest.param(lambda d: d["spec"].__setitem__("shutdownAfterJobFinishes", "yes"),
                     "is not of type 'boolean'", id="string-for-boolean"),
        pytest.param(lambda d: d["spec"].__setitem__("ttlSecondsAfterFinished", "600"),
                     "is not of type 'integer'", id="string-for-integer"),
        pytest.param(lambda d: d["spec"].__setitem__("shutdownAfterJobFinish", True),
                     "Additional properties are not allowed", id="misspelt-field"),
        pytest.param(lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"),
                     "'groupName' is a required property", id="missing-required"),
        pytest.param(lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
                     ["containers"][0]["resources"]["limits"].__setitem__("cpu", "four"),
                     "does not match", id="bad-quantity"),
    ],
)
def test_schema_rejects_broken_rayjob(mutate, expected):
    doc = copy.deepcopy(_load_digits_job())
    assert not _errors(doc)
    mutate(doc)
    errors = _errors(doc)
    assert errors, "a broken manifest passed validation"
    assert any(expected in e for e in errors), errors


def _rayjobs():
    return [(n, d) for n, d in MANIFESTS if d.get("kind") == "RayJob"]


@pytest.mark.parametrize("name,doc", _rayjobs(), ids=[n for n, _ in _rayjobs()])
def test_rayjob_entrypoint_points_at_repo_files(name, doc):
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:2] == ["python", "-m"], f"{name}: entrypoint should be `python -m MODULE ...`: {argv}"
    module = argv[2]
    module_path = REPO.joinpath(*module.split("."))
    assert module_path.with_suffix(".py").is_file() or (module_path / "__main__.py").is_file(), (
        f"{name}: entrypoint module {module} not found under {REPO}"
    )
    configs = [a for a in argv[3:] if a.endswith((".yaml", ".yml"))]
    assert configs, f"{name}: entrypoint names no config file: {argv}"
    for cfg in configs:
        assert Path(cfg).parts[0] == "configs", f"{name}: config {cfg} is not under configs/"
        assert (REPO / cfg).is_file(), f"{name}: config {cfg} does not exist"


@pytest.mark.parametrize("name,doc", _rayjobs(), ids=[n for n, _ in _rayjobs()])
def test_rayjob_runtime_env_is_offline(name, doc):
    runtime_env = yaml.safe_load(doc["spec"].get("runtimeEnvYAML", "")) or {}
    assert isinstance(runtime_env, dict), f"{name}: runtimeEnvYAML is not a mapping"
    # Ray wants env var values as strings: "1", not 1.
    assert runtime_env.get("env_vars", {}).get("HF_HUB_OFFLINE") == "1", name


def _generator():
    spec = importlib.util.spec_from_file_location("generate_crds", VENDORED / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", KINDS)
def test_vendored_schemas_are_the_generators_output_of_the_crds(kind):
    """Regenerating from the KubeRay CRDs gives the committed file byte for byte (the CRD folder sits next to
    the project's own checkout; a user's clone has only the vendored files, which every other test uses)."""
    if not CRD_DIR.is_dir():
        pytest.skip(f"the KubeRay CRD files are not at {CRD_DIR}: only their vendored schemas are here")
    gen = _generator()
    with (CRD_DIR / gen.CRD_FILES[kind]).open() as f:
        crd = yaml.load(f, Loader=Loader)
    assert gen.render(gen.vendored(crd, gen.CRD_FILES[kind])) == gen.schema_path(kind).read_text()


def test_stripping_descriptions_keeps_a_field_named_description():
    gen = _generator()
    node = {"type": "object", "description": "drop me",
            "properties": {"description": {"type": "string", "description": "the field's text"}},
            "items": {"description": "x", "type": "string"}, "anyOf": [{"description": "y", "type": "integer"}]}
    assert gen.structural(node) == {"type": "object", "properties": {"description": {"type": "string"}},
                                    "items": {"type": "string"}, "anyOf": [{"type": "integer"}]}
