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

Beyond the schemas: the RayService's serveConfigV2 passes Ray Serve's own config
schema (strictly too) and matches the code (the application builder it names is
called with its args and the deployments it lists are the ones built); the GPU
RayCluster requests GPUs, sizes /dev/shm and sets NCCL's environment; every job
command written in deploy/ loads as a config.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import re
import shlex
import types
import typing
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
REWARD_SERVICE = DEPLOY / "rayservice-reward.yaml"
GPU_CLUSTER = DEPLOY / "raycluster-gpu.yaml"
JOB_MODULE = "steadyrl.services.driver.job"

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


def _module_file(module: str) -> Path | None:
    """The file an installed module is loaded from (None: not importable). `steadyrl.services.driver.job` is the
    checkout's services/driver/job.py under the package-dir mapping of pyproject.toml (an editable install)."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    return None if spec is None or spec.origin is None else Path(spec.origin)


def _check_job_argv(where: str, argv: list[str]) -> None:
    """`python -m steadyrl.services.driver.job configs/X.yaml key=value ...`: the module is installed, the preset is
    under configs/ and the preset with those overrides is a valid config (every key exists)."""
    from steadyrl.services.config import load_config

    assert argv[:2] == ["python", "-m"], f"{where}: should be `python -m MODULE ...`: {argv}"
    module = argv[2]
    assert _module_file(module) is not None, f"{where}: module {module} is not installed"
    configs = [a for a in argv[3:] if a.endswith((".yaml", ".yml")) and "=" not in a]
    assert len(configs) == 1 and argv[3] == configs[0], f"{where}: the first argument should be one preset: {argv}"
    cfg = configs[0]
    assert Path(cfg).parts[0] == "configs", f"{where}: config {cfg} is not under configs/"
    assert (REPO / cfg).is_file(), f"{where}: config {cfg} does not exist"
    load_config(REPO / cfg, argv[4:])  # raises ConfigError naming a bad key or value


@pytest.mark.parametrize("name,doc", _rayjobs(), ids=[n for n, _ in _rayjobs()])
def test_rayjob_entrypoint_points_at_repo_files(name, doc):
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[2] == JOB_MODULE, f"{name}: entrypoint runs {argv[2]}, not the job module {JOB_MODULE}"
    _check_job_argv(name, argv)


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


# ---------------------------------------------------------------------------------------------- shared helpers

def _load(path: Path) -> dict:
    with path.open() as f:
        return yaml.load(f, Loader=Loader)


def _cluster_spec(doc: dict) -> dict:
    """The RayCluster spec inside any of the three kinds."""
    key = {"RayCluster": None, "RayJob": "rayClusterSpec", "RayService": "rayClusterConfig"}[doc["kind"]]
    return doc["spec"] if key is None else doc["spec"][key]


def _groups(doc: dict) -> list[tuple[str, dict]]:
    """(name, group spec) of the head and of every worker group."""
    spec = _cluster_spec(doc)
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity (or a byte count) in bytes."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(quantity))
    assert m, f"not a memory quantity: {quantity!r}"
    return int(m[1]) * UNITS.get(m[2] or "", 1)


def _shm_volume(group: dict, container: dict) -> dict | None:
    """The volume a container mounts at /dev/shm (None: no mount)."""
    names = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    if not names:
        return None
    return next(v for v in group["template"]["spec"].get("volumes", []) if v["name"] == names[0])


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=[n for n, _ in MANIFESTS])
def test_cluster_ray_version_is_the_installed_ray_and_the_gpu_base_image(name, doc):
    """KubeRay reads rayVersion to pick features; the tests (and the CPU image's pip install) run the installed Ray,
    and deploy/Dockerfile's GPU build uses rayproject/ray:<rayVersion>: all three must agree."""
    import ray

    version = _cluster_spec(doc)["rayVersion"]
    assert version == ray.__version__, f"{name}: rayVersion {version} but Ray {ray.__version__} is installed"
    tags = set(re.findall(r"rayproject/ray:([\w.]+?)-py", (DEPLOY / "Dockerfile").read_text()))
    assert tags == {version}, f"{name}: rayVersion {version}, deploy/Dockerfile's GPU base image tags {tags}"


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=[n for n, _ in MANIFESTS])
def test_head_and_workers_run_one_image_in_workdir_app_with_a_memory_dev_shm(name, doc):
    """Ray needs the same Ray and Python on every node; relative preset paths resolve against /app; the object
    store needs a /dev/shm larger than the container default of 64 MiB (a memory emptyDir, at least the
    object-store-memory the group sets)."""
    images = set()
    for group_name, group in _groups(doc):
        for c in group["template"]["spec"]["containers"]:
            images.add(c["image"])
            assert c.get("workingDir") == "/app", f"{name} {group_name}/{c['name']}: workingDir is not /app"
            shm = _shm_volume(group, c)
            assert shm is not None, f"{name} {group_name}/{c['name']}: nothing mounted at /dev/shm"
            assert shm.get("emptyDir", {}).get("medium") == "Memory", f"{name} {group_name}: /dev/shm is not memory"
            size = _bytes(shm["emptyDir"]["sizeLimit"])
            assert size > 64 * 2**20, f"{name} {group_name}: /dev/shm is no larger than the 64 MiB default"
            store = group["rayStartParams"].get("object-store-memory")
            if store is not None:
                assert size >= int(store), (f"{name} {group_name}: /dev/shm ({size} B) is smaller than "
                                            f"object-store-memory ({store} B): Ray falls back to slow /tmp")
            limit = c["resources"]["limits"]["memory"]
            assert size < _bytes(limit), f"{name} {group_name}: /dev/shm counts against the memory limit {limit}"
    assert len(images) == 1, f"{name}: head and workers run different images {images}"


def _job_commands(text: str) -> list[list[str]]:
    """argv of every `python -m steadyrl.services.driver.job ...` in a text (manifest comments, Markdown)."""
    found = re.findall(r"python -m " + re.escape(JOB_MODULE) + r"[^`\n]*", text)
    return [shlex.split(re.split(r"\s#", cmd)[0]) for cmd in found]  # without a trailing `# comment`


DOCUMENTED = [DEPLOY / "README.md", *sorted(DEPLOY.glob("*.yaml"))]


@pytest.mark.parametrize("path", DOCUMENTED, ids=[p.name for p in DOCUMENTED])
def test_documented_job_commands_use_real_presets_and_config_keys(path):
    """Every job command written out in deploy/ (e.g. `ray job submit ... -- python -m steadyrl.services.driver.job
    configs/digits-grpo.yaml ray.rollout_gpus=1 ...`) loads: its preset exists and each override names a real key
    with a valid value."""
    commands = _job_commands(path.read_text())
    if path in (GPU_CLUSTER, DEPLOY / "README.md"):
        assert commands, f"{path.name} shows no job command"
    for argv in commands:
        _check_job_argv(f"{path.name}: {shlex.join(argv)}", argv)


def test_gpu_cluster_submit_commands_ask_for_gpus():
    """The GPU cluster's documented jobs use its GPUs: each asks Ray for some (on the command line or in its
    preset), and one runs learner ranks across pods, the case the NCCL settings are for."""
    from steadyrl.services.config import load_config

    commands = _job_commands(GPU_CLUSTER.read_text())
    assert len(commands) >= 2
    configs = [load_config(REPO / argv[3], argv[4:]) for argv in commands]
    for argv, cfg in zip(commands, configs):
        assert cfg.ray.rollout_gpus > 0 and cfg.ray.learner_gpus > 0, f"runs on CPU: {shlex.join(argv)}"
    assert any(cfg.learner.ranks > 1 for cfg in configs), "no command runs several learner ranks"


# ---------------------------------------------------------------------------------------------- roles

ROLE_LABEL = "steadyrl.io/role"


def _as_nodes(doc: dict) -> list[dict]:
    """Each worker group's pods as Ray will list them (`ray.nodes()`): CPUs (num-cpus, else the container's
    CPU limit), GPUs (num-gpus), the group's custom resources and labels (KubeRay passes both to `ray start`)."""
    nodes = []
    for name, group in _groups(doc)[1:]:
        (container,) = group["template"]["spec"]["containers"]
        params, limit = group["rayStartParams"], str(container["resources"]["limits"]["cpu"])
        cpus = float(params.get("num-cpus", int(limit[:-1]) / 1000 if limit.endswith("m") else limit))
        resources = {"CPU": cpus, "GPU": float(params.get("num-gpus", 0)), **group.get("resources", {})}
        nodes.append({"Alive": True, "NodeManagerAddress": name, "Resources": resources,
                      "Labels": dict(group.get("labels", {}))})
    return nodes


@pytest.mark.parametrize("path", [GPU_CLUSTER, DIGITS_JOB], ids=lambda p: p.name)
def test_each_role_of_a_cluster_preset_fits_the_worker_group_labelled_for_it(path):
    """One worker group per role, labelled `steadyrl.io/role: <role>`; every job command the manifest shows that
    places roles (ray.roles) finds, for the rollout workers, the learner ranks and the reward replicas, a group
    with the role's labels and enough CPUs and GPUs for one of its actors (the check `steadyrl train` runs on
    the live cluster, `runtime/node_fit.py`)."""
    from steadyrl.services.config import load_config
    from steadyrl.services.runtime.node_fit import check_roles_fit, reward_demand, training_demands
    from steadyrl.services.testbeds import build_testbed

    doc = _load(path)
    labelled = {g["groupName"]: g.get("labels", {}).get(ROLE_LABEL) for _, g in _groups(doc)[1:]}
    assert labelled == {role: role for role in ("rollout", "learner", "reward")}, labelled
    placed = 0
    for argv in _job_commands(path.read_text()):
        cfg = load_config(REPO / argv[3], argv[4:])
        roles = cfg.ray.roles
        if not (roles.rollout.labels and roles.learner.labels and roles.reward.labels):
            continue
        placed += 1
        check_roles_fit([*training_demands(cfg), reward_demand(cfg, build_testbed(cfg))], _as_nodes(doc))
        for role in ("rollout", "learner", "reward"):  # each role on its own group, no other
            fits = [n["NodeManagerAddress"] for n in _as_nodes(doc) if n["Labels"] == getattr(roles, role).labels]
            assert fits == [role], (shlex.join(argv), role, fits)
    assert placed, f"{path.name} shows no job command that places its roles"


def test_the_rayjob_retries_into_the_same_run_folder_on_a_volume_every_pod_shares():
    """A lost driver costs the steps since the last checkpoint: KubeRay retries the job (backoffLimit), the same
    entrypoint continues its run folder (run.resume=auto), and that folder lies on one ReadWriteMany claim that
    the head (the driver) and every worker (the learner's checkpoints) mount."""
    from steadyrl.services.config import load_config

    doc = _load_digits_job()
    assert doc["spec"].get("backoffLimit", 0) >= 1
    argv = shlex.split(doc["spec"]["entrypoint"])
    cfg = load_config(REPO / argv[3], argv[4:])
    assert cfg.run.resume == "auto" and cfg.run.run_dir
    claims = set()
    for name, group in _groups(doc):
        (container,) = group["template"]["spec"]["containers"]
        mounts = [m for m in container["volumeMounts"] if cfg.run.run_dir.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{name}: nothing mounted where run.run_dir={cfg.run.run_dir} lies"
        volume = next(v for v in group["template"]["spec"]["volumes"] if v["name"] == mounts[0]["name"])
        claims.add(volume.get("persistentVolumeClaim", {}).get("claimName"))
    assert len(claims) == 1 and None not in claims, claims
    assert "ReadWriteMany" in DIGITS_JOB.read_text()  # the claim's creation is shown


# ---------------------------------------------------------------------------------------------- RayCluster (GPU)

def _gpu_cluster() -> dict:
    return _load(GPU_CLUSTER)


def test_gpu_cluster_head_does_no_work_and_has_no_gpu():
    head = _gpu_cluster()["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "tasks and actors would be scheduled on the head"
    for c in head["template"]["spec"]["containers"]:
        for kind in ("requests", "limits"):
            assert "nvidia.com/gpu" not in c["resources"].get(kind, {}), f"head {kind} a GPU"


def test_gpu_workers_request_gpus_that_ray_advertises():
    """Each GPU worker container requests nvidia.com/gpu (limit = request: extended resources are not
    overcommitted), Ray advertises as many (num-gpus), and the pods go to GPU nodes (selector + toleration)."""
    groups = _gpu_cluster()["spec"]["workerGroupSpecs"]
    gpu_groups = [g for g in groups if any("nvidia.com/gpu" in c["resources"].get("limits", {})
                                           for c in g["template"]["spec"]["containers"])]
    assert gpu_groups, "no worker group has nvidia.com/gpu in its limits"
    for g in gpu_groups:
        (container,) = g["template"]["spec"]["containers"]
        limits, requests = container["resources"]["limits"], container["resources"].get("requests", {})
        gpus = int(limits["nvidia.com/gpu"])
        assert gpus >= 1
        assert int(requests.get("nvidia.com/gpu", gpus)) == gpus, "GPU request differs from the limit"
        assert g["rayStartParams"].get("num-gpus") == str(gpus), "num-gpus differs from the nvidia.com/gpu limit"
        pod = g["template"]["spec"]
        assert pod.get("nodeSelector"), f"{g['groupName']}: no nodeSelector for GPU nodes"
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), (
            f"{g['groupName']}: no toleration of the nvidia.com/gpu taint")
        assert container["image"].endswith(":gpu"), f"{g['groupName']}: {container['image']} is not the GPU image"


def test_gpu_workers_configure_nccl_for_a_pod_network():
    """NCCL in a pod: an interface other pods reach, no InfiniBand probing, a readable debug level. Values are
    strings (the schema checks that too) and each variable is explained in the manifest's comments."""
    text = GPU_CLUSTER.read_text()
    for g in _gpu_cluster()["spec"]["workerGroupSpecs"]:
        (container,) = g["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("NCCL_SOCKET_IFNAME") and env.get("NCCL_DEBUG") in ("WARN", "INFO", "VERSION"), env
        assert env.get("NCCL_IB_DISABLE") == "1", env
        for var in [k for k in env if k.startswith("NCCL_")] + ["NCCL_P2P_DISABLE"]:
            assert re.search(rf"^#\s+{var}\b", text, re.MULTILINE), f"{var} is not explained in the comments"


@pytest.mark.parametrize(
    "mutate,path,expected",
    [
        pytest.param(lambda d: d["spec"]["workerGroupSpecs"][0]["rayStartParams"].__setitem__("num-gpus", 1),
                     "spec.workerGroupSpecs.0.rayStartParams.num-gpus", "is not of type 'string'",
                     id="integer-ray-start-param"),
        pytest.param(lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
                     .__setitem__("resource", {"limits": {"nvidia.com/gpu": "1"}}),
                     "spec.workerGroupSpecs.0.template.spec.containers.0", "'resource' was unexpected",
                     id="misspelt-container-field"),
        pytest.param(lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["tolerations"][0]
                     .__setitem__("effect", ["NoSchedule"]),
                     "spec.workerGroupSpecs.0.template.spec.tolerations.0.effect", "is not of type 'string'",
                     id="list-for-string"),
        pytest.param(lambda d: d["spec"]["workerGroupSpecs"][0].pop("groupName"),
                     "spec.workerGroupSpecs.0", "'groupName' is a required property", id="missing-group-name"),
    ],
)
def test_schema_rejects_broken_raycluster_naming_the_path(mutate, path, expected):
    doc = copy.deepcopy(_gpu_cluster())
    assert not _errors(doc)
    mutate(doc)
    errors = _errors(doc)
    assert any(e.startswith(f"{path}: ") and expected in e for e in errors), errors


# ---------------------------------------------------------------------------------------------- RayService

REWARD_BUILDER = "steadyrl.services.serving.app:app_builder"


def _reward_service() -> dict:
    return _load(REWARD_SERVICE)


def _serve_config(doc: dict | None = None) -> dict:
    config = yaml.safe_load((doc or _reward_service())["spec"]["serveConfigV2"])
    assert isinstance(config, dict), "serveConfigV2 is not a YAML mapping"
    return config


def _reward_app(config: dict) -> dict:
    apps = [a for a in config["applications"] if a["import_path"].split(":")[0] == REWARD_BUILDER.split(":")[0]]
    assert len(apps) == 1, f"serveConfigV2 should deploy services/serving/ once: {config['applications']}"
    return apps[0]


def _models_in(annotation) -> tuple[list[type], bool]:
    """(pydantic models a field's annotation allows, whether it also allows a plain dict), through Optional,
    Union, Annotated and List."""
    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [_models_in(a) for a in args]
        return [m for ms, _ in parts for m in ms], any(plain for _, plain in parts)
    if origin is typing.Annotated:
        return _models_in(args[0])
    if origin is list:
        return _models_in(args[0]) if args else ([], True)
    if origin is dict or annotation is dict:
        return [], True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    return [], False


def _unknown_serve_fields(value, model, path: str = "") -> list[str]:
    """Keys Ray Serve's config schema does not declare. Serve's schemas accept and ignore unknown keys (forward
    compatibility), so a misspelt `num_replica` would silently do nothing; here, as for the CRD, it is an error."""
    if isinstance(value, list):
        return [e for i, item in enumerate(value) for e in _unknown_serve_fields(item, model, f"{path}{i}.")]
    if not isinstance(value, dict):
        return []
    fields = {alias for name, f in model.model_fields.items() for alias in (name, f.alias) if alias}
    errors = [f"{path}{key}: not a field of {model.__name__}" for key in value if key not in fields]
    for key, sub in value.items():
        if key in model.model_fields:
            models, plain = _models_in(model.model_fields[key].annotation)
            if len(models) == 1 and not plain:
                errors += _unknown_serve_fields(sub, models[0], f"{path}{key}.")
    return errors


def _serve_errors(config: dict) -> list[str]:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as err:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
    return _unknown_serve_fields(config, ServeDeploySchema)


def test_reward_service_serve_config_is_a_valid_strict_serve_config():
    """serveConfigV2 is what KubeRay PUTs to the Serve REST API: it must pass Ray Serve's ServeDeploySchema, with
    no keys the schema does not declare."""
    errors = _serve_errors(_serve_config())
    assert not errors, "serveConfigV2 fails Ray Serve's config schema:\n" + "\n".join(errors)


@pytest.mark.parametrize(
    "mutate,path,expected",
    [
        pytest.param(lambda c: c["applications"][0]["deployments"][0].__setitem__("num_replica", 2),
                     "applications.0.deployments.0.num_replica", "not a field of DeploymentSchema", id="misspelt"),
        pytest.param(lambda c: c["applications"][0]["deployments"][0].__setitem__("num_replicas", "two"),
                     "applications.0.deployments.0", "`num_replicas` must be an int", id="wrong-type"),
        pytest.param(lambda c: c["applications"][0].__setitem__("routeprefix", "/reward"),
                     "applications.0.routeprefix", "not a field of ServeApplicationSchema", id="misspelt-app-field"),
        pytest.param(lambda c: c["http_options"].__setitem__("prot", 8000),
                     "http_options.prot", "not a field of HTTPOptionsSchema", id="misspelt-http-option"),
    ],
)
def test_serve_config_check_rejects_broken_configs_naming_the_path(mutate, path, expected):
    config = _serve_config()
    assert not _serve_errors(config)
    mutate(config)
    errors = _serve_errors(config)
    assert any(e.startswith(f"{path}: ") and expected in e for e in errors), errors


def test_reward_service_routes_match_the_code():
    """The app is the one the code and the trainer address: name APP_NAME under ROUTE_PREFIX, served on the port
    the head container exposes as `serve` (KubeRay's <name>-serve-svc targets it)."""
    from steadyrl.services.serving import APP_NAME, ROUTE_PREFIX

    doc = _reward_service()
    config = _serve_config(doc)
    app = _reward_app(config)
    assert app["import_path"] == REWARD_BUILDER
    assert app["name"] == APP_NAME
    assert app["route_prefix"] == ROUTE_PREFIX
    port = config.get("http_options", {}).get("port", 8000)
    (head,) = doc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    serve_ports = [p["containerPort"] for p in head.get("ports", []) if p.get("name") == "serve"]
    assert serve_ports == [port], f"Serve listens on {port}; the head's `serve` port is {serve_ports}"
    text = REWARD_SERVICE.read_text()
    assert f"localhost:{port}{ROUTE_PREFIX}/healthz" in text, "the query example does not use the route and port"


def test_reward_service_builder_args_are_a_valid_config():
    """The builder's args are a preset under configs/ and overrides of real keys, as the command line takes them."""
    app = _reward_app(_serve_config())
    args = app.get("args", {})
    assert set(args) <= {"config", "overrides"}, f"args outside the builder's contract: {sorted(args)}"
    overrides = args.get("overrides", [])
    assert isinstance(overrides, list) and all(isinstance(o, str) for o in overrides), overrides
    _check_job_argv("serveConfigV2 args", ["python", "-m", JOB_MODULE, args["config"], *overrides])


def test_reward_service_leaves_actor_options_to_the_code():
    """A deployments entry's ray_actor_options replaces the code's (CPU share, a cuda model's GPU share) instead
    of merging with it; replica resources are set through the builder's `serve.*` overrides instead."""
    for d in _reward_app(_serve_config()).get("deployments", []):
        assert "ray_actor_options" not in d, f"deployment {d['name']} overrides the code's ray_actor_options"


def _built_deployments(app_config: dict) -> tuple[str, list]:
    """(ingress name, deployments) of the application exactly as Serve's controller builds it from a config
    entry: import the builder, call it with `args` (checking its one-parameter signature), build the graph
    (unique deployment names). No Ray is started: the build only binds deployments.

    These helpers are what Serve's build task runs (ray/serve/_private/application_state.py:
    build_serve_application); Ray has no public equivalent. They are private, so a Ray upgrade may move them:
    the version is the one rayVersion pins (test_cluster_ray_version_is_the_installed_ray...)."""
    from ray._common.utils import import_attr
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    app = call_user_app_builder_with_args_if_necessary(import_attr(app_config["import_path"]),
                                                       app_config.get("args", {}))
    assert isinstance(app, Application)
    built = build_app(app, name=app_config["name"])
    built.validate_single_fastapi_ingress()
    return built.ingress_deployment_name, built.deployments


def test_reward_service_import_path_resolves_to_an_application_builder():
    from ray._common.utils import import_attr

    app = _reward_app(_serve_config())
    module = app["import_path"].split(":")[0]
    assert _module_file(module) is not None, f"{module} is not installed"
    builder = import_attr(app["import_path"])
    assert callable(builder), f"{app['import_path']} is not callable"


def test_reward_service_deployments_are_the_ones_the_builder_builds():
    """Serve refuses a config whose `deployments` name one the application lacks, and a deployment it builds but
    the config leaves out runs with the code's defaults: the names must be the same set."""
    app = _reward_app(_serve_config())
    ingress, deployments = _built_deployments(app)
    built = sorted(d.name for d in deployments)
    listed = [d["name"] for d in app.get("deployments", [])]
    assert len(listed) == len(set(listed)), f"a deployment is listed twice: {listed}"
    assert sorted(listed) == built, f"serveConfigV2 lists {sorted(listed)}; the builder builds {built}"
    assert ingress == "ensemble"


@pytest.mark.parametrize(
    "mutate,path,expected",
    [
        pytest.param(lambda d: d["spec"].__setitem__("serveConfigV2", _serve_config()),
                     "spec.serveConfigV2", "is not of type 'string'", id="mapping-for-yaml-string"),
        pytest.param(lambda d: d["spec"].__setitem__("serveConfig", d["spec"]["serveConfigV2"]),
                     "spec", "'serveConfig' was unexpected", id="unknown-field"),
        pytest.param(lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
                     ["ports"][3].__setitem__("containerPort", "8000"),
                     "spec.rayClusterConfig.headGroupSpec.template.spec.containers.0.ports.3.containerPort",
                     "is not of type 'integer'", id="string-for-port"),
        pytest.param(lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].__setitem__("replicas", "1"),
                     "spec.rayClusterConfig.workerGroupSpecs.0.replicas", "is not of type 'integer'",
                     id="string-for-replicas"),
    ],
)
def test_schema_rejects_broken_rayservice_naming_the_path(mutate, path, expected):
    doc = copy.deepcopy(_reward_service())
    assert not _errors(doc)
    mutate(doc)
    errors = _errors(doc)
    assert any(e.startswith(f"{path}: ") and expected in e for e in errors), errors
