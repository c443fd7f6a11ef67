"""The KubeRay manifests under k8s/, checked offline.

- KubeRay kinds (RayCluster, RayJob) against the CRD schemas of KubeRay v1.7.0 in tests/data/kuberay-crds,
  made strict (a misspelled key fails; see that folder's README); core kinds, and the pod templates inside
  the RayCluster, with kubernetes-validate for one Kubernetes version.
- Every worker group's pods hold the job spec it is sized for: the planner plans that spec on a node with
  the pod's memory limit, GPU count and GPU memory, and must say it fits (with the GPUs its resources.gpus
  asks for), within its tenant's quota. The whole-node overlay gives one pod all 8 GPUs of its server and a
  job that asks for all of them.
- Memory requests equal limits, probes, secrets, storage paths and commands agree with the code they run.

Each overlay under k8s/overlays/ is rendered with the small subset of kustomize these manifests use
(resources, namespace, JSON 6902 patches, images); where kubectl is installed, a test checks that subset
against `kubectl kustomize`.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRD_DIR = ROOT / "tests" / "data" / "kuberay-crds" / "v1.7.0"  # KubeRay v1.7.0, Apache-2.0 (README there)
K8S_VERSION = "1.30.0"  # the Kubernetes version the core kinds are validated for
IMAGE = "ghcr.io/horizon-ray/horizon-ray:0.1.0"  # Ray head and workers, RayJob submitters
API_IMAGE = "ghcr.io/horizon-ray/horizon-ray-api:0.1.0"  # the API: k8s/Dockerfile's CPU-only target "api"
CRD_SCHEMAS = {"RayCluster": "rayclusters", "RayJob": "rayjobs", "RayService": "rayservices"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
SIZED_FOR = "horizon-ray.io/sized-for"  # worker group annotation: the job spec its pods are sized for
JOBS_CONFIGMAP = "horizon-ray-jobs"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # GPU feature discovery: MiB of one GPU
NODE_SHAPE = "horizon-ray.io/node-shape"  # worker group annotation: the node its pods are cut from (JSON)
TOKEN_SECRET = ("horizon-ray", "auth_token")  # the Secret KubeRay generates for authOptions.mode token
GiB, MiB = 1 << 30, 1 << 20
PER_GPU = "overlays/h200-2tib"  # an 8-GPU server cut into 8 pods of one GPU
WHOLE_NODE = "overlays/h200-2tib-node"  # the same server as one pod of 8 GPUs

VARIANTS = ["base"] + sorted(
    str(p.parent.relative_to(K8S)) for p in (K8S / "overlays").glob("*/kustomization.yaml")
)


# ---- rendering: the subset of kustomize the manifests use ----------------------------------------------


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(directory: Path) -> list[dict[str, Any]]:
    """The resources of a kustomization directory, as `kubectl kustomize` builds them."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(k) - {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
    if unsupported:
        raise ValueError(f"{directory}/kustomization.yaml uses {sorted(unsupported)}, which this test's renderer "
                         "does not implement; extend render() in tests/unit/test_k8s.py")
    docs: list[dict[str, Any]] = []
    for entry in k.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else load_docs(path)
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text())
        targets = [d for d in docs if _matches(d, patch["target"])]
        assert len(targets) == 1, f"{directory}: patch target {patch['target']} matches {len(targets)} resources"
        json_patch(targets[0], ops)
    for image in k.get("images", []):
        for container in _all_containers(docs):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    return docs


def _matches(doc: dict[str, Any], target: dict[str, str]) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    want = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    return all(want[key] == value for key, value in target.items())


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> None:
    """RFC 6902 add / remove / replace / test, in place."""
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        key: Any = (len(parent) if last == "-" else int(last)) if isinstance(parent, list) else last
        kind = op["op"]
        if kind == "test":
            assert parent[key] == op["value"], f"patch test failed at {op['path']}: {parent[key]!r}"
        elif kind == "remove":
            del parent[key]
        elif kind == "add" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(op["value"]))
        elif kind == "add" or (kind == "replace" and (isinstance(parent, list) or key in parent)):
            parent[key] = copy.deepcopy(op["value"])
        else:
            raise ValueError(f"unsupported or impossible patch operation {op}")


def docs_of(name: str) -> list[dict[str, Any]]:
    """The rendered resources of base or an overlay, with the examples (they run against any of them)."""
    docs = render(K8S / name)
    for path in sorted((K8S / "examples").glob("*.yaml")):
        docs += load_docs(path)
    return docs


def base_docs() -> list[dict[str, Any]]:
    return docs_of("base")


@pytest.fixture(params=VARIANTS)
def variant(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, docs_of(request.param)


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) of every resource that creates pods."""
    out = []
    for d in docs:
        name, spec = d["metadata"]["name"], d.get("spec", {})
        if d["kind"] == "RayCluster":
            out.append((f"RayCluster {name} head", spec["headGroupSpec"]["template"]))
            for g in spec.get("workerGroupSpecs", []):
                out.append((f"RayCluster {name} group {g['groupName']}", g["template"]))
        elif d["kind"] in ("Deployment", "StatefulSet", "Job"):
            out.append((f"{d['kind']} {name}", spec["template"]))
        elif d["kind"] == "RayJob" and "submitterPodTemplate" in spec:
            out.append((f"RayJob {name} submitter", spec["submitterPodTemplate"]))
        elif d["kind"] == "Pod":
            out.append((f"Pod {name}", d))
    return out


def _all_containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for _, t in pod_templates(docs) for c in t["spec"].get("containers", [])
            + t["spec"].get("initContainers", [])]


def container(template: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in template["spec"]["containers"] if c["name"] == name]
    assert found, f"no container {name} in the pod template"
    return found[0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    """name -> value (str) or valueFrom (dict)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def quantity(text: str | int) -> float:
    """A Kubernetes quantity ("120Gi", "16", "500m", "1e9") as a number (bytes, cores)."""
    m = re.fullmatch(r"([0-9.]+(?:[eE][+-]?[0-9]+)?)([KMGTPE]i|[numkMGTPE])?", str(text).strip())
    assert m, f"not a Kubernetes quantity: {text!r}"
    scale = {None: 1, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
             "E": 1e18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    return float(m.group(1)) * scale[m.group(2)]


# ---- schemas -------------------------------------------------------------------------------------------


def strict_schema(schema: Any) -> Any:
    """The CRD schema with `additionalProperties: false` wherever it lists properties and does not keep
    unknown fields, and x-kubernetes-int-or-string as integer-or-string (tests/data/kuberay-crds/README.md)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: strict_schema(s) for name, s in out["properties"].items()}
        if not out.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in out:
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = strict_schema(out[key])
    if out.get("x-kubernetes-int-or-string") and not any(k in out for k in ("anyOf", "oneOf")):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def crd_validator(kind: str, strict: bool = True):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (dev extra) validates the CRD kinds")
    schema = json.loads((CRD_DIR / f"{CRD_SCHEMAS[kind]}.schema.json").read_text())
    return jsonschema.Draft7Validator(strict_schema(schema) if strict else schema)


def crd_errors(doc: dict[str, Any], strict: bool = True) -> list[str]:
    validator = crd_validator(doc["kind"], strict)
    return [f"{doc['kind']} {doc['metadata']['name']} at {'.'.join(map(str, e.absolute_path)) or '(top)'}: "
            f"{e.message}" for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.path)))]


def core_errors(doc: dict[str, Any]) -> list[str]:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra) validates core kinds")
    try:
        kv.validate(doc, K8S_VERSION, strict=True)
    except kv.ValidationError as exc:  # str(exc) quotes the whole schema: keep the message and the path
        return [f"{doc['kind']} {doc['metadata'].get('name')} at {'.'.join(map(str, exc.absolute_path))}: "
                f"{exc.message}"]
    return []


def template_as_pod_template(where: str, template: dict[str, Any]) -> dict[str, Any]:
    """A pod template of a custom resource, wrapped as a core PodTemplate for kubernetes-validate."""
    name = re.sub(r"[^a-z0-9-]+", "-", where.lower()).strip("-")
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def test_kuberay_kinds_match_the_crd_schemas(variant):
    name, docs = variant
    kinds = [d for d in docs if d["kind"] in CRD_SCHEMAS]
    assert {d["kind"] for d in kinds} >= {"RayCluster", "RayJob"}
    errors = [e for d in kinds for e in crd_errors(d)]
    assert not errors, f"{name}:\n" + "\n".join(errors)


def test_core_kinds_and_pod_templates_validate(variant):
    name, docs = variant
    core = [d for d in docs if d["kind"] not in CRD_SCHEMAS]
    assert {d["kind"] for d in core} >= {"Deployment", "Service", "PersistentVolumeClaim", "Secret", "ConfigMap"}
    # The pod templates inside the RayCluster/RayJob, against Kubernetes' own PodTemplate schema too.
    wrapped = [template_as_pod_template(w, t) for w, t in pod_templates(docs) if w.startswith(("RayCluster", "RayJob"))]
    errors = [e for d in core + wrapped for e in core_errors(d)]
    assert not errors, f"{name}:\n" + "\n".join(errors)


def test_a_planted_typo_fails_the_crd_schema():
    docs = base_docs()
    cluster = copy.deepcopy(one(docs, "RayCluster"))
    resources = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    resources["limts"] = resources.pop("limits")
    cluster["spec"]["workerGroupSpecs"][0]["rayStartParam"] = cluster["spec"]["workerGroupSpecs"][0].pop(
        "rayStartParams")
    errors = crd_errors(cluster)
    assert any("'limts' was unexpected" in e for e in errors), errors
    assert any("'rayStartParam' was unexpected" in e for e in errors), errors
    # The schemas as KubeRay ships them would let both typos through: that is why they are made strict.
    assert crd_errors(cluster, strict=False) == []

    job = copy.deepcopy(one(docs, "RayJob"))
    job["spec"]["entrypiont"] = job["spec"].pop("entrypoint")
    assert any("'entrypiont' was unexpected" in e for e in crd_errors(job))


def test_a_planted_typo_fails_the_core_schema():
    docs = base_docs()
    deployment = copy.deepcopy(one(docs, "Deployment"))
    api = deployment["spec"]["template"]["spec"]["containers"][0]
    api["readinesProbe"] = api.pop("readinessProbe")
    errors = core_errors(deployment)
    assert errors and "readinesProbe" in errors[0], errors

    cluster = one(docs, "RayCluster")
    template = copy.deepcopy(cluster["spec"]["headGroupSpec"]["template"])
    template["spec"]["containers"][0]["volumeMount"] = template["spec"]["containers"][0].pop("volumeMounts")
    errors = core_errors(template_as_pod_template("head", template))
    assert errors and "volumeMount" in errors[0], errors


def test_strict_schema_keeps_int_or_string_and_preserved_objects():
    schema = {"type": "object", "properties": {
        "port": {"x-kubernetes-int-or-string": True},
        "free": {"type": "object", "properties": {"a": {"type": "string"}},
                 "x-kubernetes-preserve-unknown-fields": True}}}
    jsonschema = pytest.importorskip("jsonschema")
    v = jsonschema.Draft7Validator(strict_schema(schema))
    assert v.is_valid({"port": 8080}) and v.is_valid({"port": "http"})
    assert v.is_valid({"free": {"a": "x", "anything": 1}})
    assert not v.is_valid({"prot": 8080})


# ---- the planner: every worker group holds the job it is sized for --------------------------------------


def worker_node(group: dict[str, Any]):
    """The planner's NodeSpec of one pod of a worker group: its memory limit, GPUs and GPU memory."""
    from horizon_ray.planner import NodeSpec

    ray = group["template"]["spec"]["containers"][0]  # KubeRay's Ray container is the first one
    limits = ray["resources"]["limits"]
    gpus = int(quantity(limits.get("nvidia.com/gpu", 0)))
    gpu_mem = 0
    if gpus:
        terms = (group["template"]["spec"].get("affinity", {}).get("nodeAffinity", {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", []))
        floors = []
        for term in terms:  # the scheduler needs one term to match: the smallest floor is guaranteed
            exprs = [e for e in term.get("matchExpressions", []) if e["key"] == GPU_MEMORY_LABEL]
            floors.append(min((int(v) + (e["operator"] == "Gt")) for e in exprs for v in e["values"]) if exprs
                          else 0)
        gpu_mem = min(floors, default=0) * MiB
    return NodeSpec(ram_bytes=offered_ram(group), gpus=gpus, gpu_mem_bytes=gpu_mem, name=group["groupName"])


def offered_ram(group: dict[str, Any]) -> int:
    """The RAM a worker group's agent offers to jobs: the pod's memory limit less what Ray takes of it, its
    object store and its processes (horizon_ray.cluster.ray_actors.ray_reserved_bytes)."""
    from horizon_ray.cluster.agent import RAY_PROCESSES_BYTES

    limit = int(quantity(group["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]))
    store = group.get("rayStartParams", {}).get("object-store-memory")
    assert store, (f"worker group {group['groupName']} sets no object-store-memory: Ray would take 30 % of the "
                   "pod's memory for it")
    return limit - int(quantity(store)) - RAY_PROCESSES_BYTES


def planned_spec(text: str) -> dict[str, Any]:
    """A job spec from the ConfigMap, loaded strictly; a model directory this machine cannot see is planned
    by its name as a preset (Qwen2.5-7B-Instruct -> qwen2.5-7b), as a node that sees it would read it."""
    from horizon_ray.jobspec import JobSpec

    spec = JobSpec.from_dict(yaml.safe_load(text)).to_dict()
    if not Path(spec["model"]["path"]).exists():
        spec["model"]["path"] = Path(spec["model"]["path"]).name
    return spec


def fit_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Why some worker group's pods cannot hold the job spec it is sized for (empty when all fit)."""
    from horizon_ray.planner import format_bytes, plan_for_spec

    cluster = one(docs, "RayCluster")
    jobs = one(docs, "ConfigMap", JOBS_CONFIGMAP)["data"]
    problems = []
    for group in cluster["spec"]["workerGroupSpecs"]:
        name = group["groupName"]
        key = group["template"].get("metadata", {}).get("annotations", {}).get(SIZED_FOR)
        if key not in jobs:
            problems.append(f"worker group {name}: annotation {SIZED_FOR} must name a key of ConfigMap "
                            f"{JOBS_CONFIGMAP} (one of {sorted(jobs)}), got {key!r}")
            continue
        node = worker_node(group)
        if node.gpus and not node.gpu_mem_bytes:
            problems.append(f"worker group {name} has GPUs but no required {GPU_MEMORY_LABEL} node affinity: "
                            "the GPU memory of its pods is unknown")
            continue
        p = plan_for_spec(planned_spec(jobs[key]), node)
        if not p.fits:
            problems.append(f"worker group {name}: {key} does not fit its pods ({format_bytes(node.ram_bytes)} "
                            f"offered after Ray's share): {p.reason}")
    return problems


def test_every_worker_group_holds_the_job_it_is_sized_for(variant):
    name, docs = variant
    assert fit_problems(docs) == [], name


def test_a_memory_limit_below_the_plan_fails_the_fit_check():
    from horizon_ray.planner import plan_for_spec

    docs = base_docs()
    group = one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]
    node = worker_node(group)
    assert node.gpus == 1 and node.gpu_mem_bytes == 40001 * MiB
    spec = planned_spec(one(docs, "ConfigMap", JOBS_CONFIGMAP)["data"][group["template"]["metadata"]
                                                                      ["annotations"][SIZED_FOR]])
    host = plan_for_spec(spec, node).host_bytes
    assert 100 * GiB < host < 110 * GiB  # the 7B sample job: 104.3 GiB
    # The smallest limit that holds it with Ray's share, less 1 GiB, set the way a hand edit would (requests
    # too): it would have held the job were Ray's share not counted.
    limit = int(quantity(group["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]))
    ray_share = limit - node.ram_bytes
    assert ray_share == 3 * GiB  # a 2 GiB object store and Ray's processes
    below = f"{(node.ram_needed_for(host) + ray_share - GiB) // MiB}Mi"
    resources = group["template"]["spec"]["containers"][0]["resources"]
    resources["limits"]["memory"] = resources["requests"]["memory"] = below
    problems = fit_problems(docs)
    assert len(problems) == 1 and "worker group gpu-bigmem" in problems[0] and "does not fit" in problems[0], \
        problems
    assert "host RAM needs 104.3 GiB" in problems[0]


def test_a_gpu_group_without_gpu_memory_fails_the_fit_check():
    docs = base_docs()
    del one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]["affinity"]
    problems = fit_problems(docs)
    assert len(problems) == 1 and GPU_MEMORY_LABEL in problems[0], problems


def quota_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Job specs of ConfigMap horizon-ray-jobs that the coordinator would refuse for their tenant's quota: it
    admits a job only when its smallest plan on a node that holds it is within the tenant's
    max_reserved_bytes (Coordinator._admit). The tenant is the one the spec's output_dir names
    (<jobs root>/<tenant>/<job>), whose quotas come from the tenants file the head's sidecar hands over."""
    from horizon_ray.cluster.tenants import TenantsConfig
    from horizon_ray.planner import format_bytes, plan_for_spec

    args, control, template = control_args(docs)
    tenants_file = Path(args.tenants)
    mount = mounts(control)[str(tenants_file.parent)]
    config = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])["configMap"]["name"]
    tenants = TenantsConfig.from_dict(yaml.safe_load(one(docs, "ConfigMap", config)["data"][tenants_file.name]))
    jobs_root = f"{args.root}/jobs"
    nodes = [worker_node(g) for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]]
    problems = []
    for key, text in one(docs, "ConfigMap", JOBS_CONFIGMAP)["data"].items():
        spec = planned_spec(text)
        tenant = Path(spec["output_dir"]).relative_to(jobs_root).parts[0]
        fitting = [p.host_bytes for p in (plan_for_spec(spec, n, suggest=False) for n in nodes) if p.fits]
        quota = tenants.quota(tenant).max_reserved_bytes
        if fitting and min(fitting) > quota:
            problems.append(f"{key} needs {format_bytes(min(fitting))} of host RAM; tenant {tenant}'s "
                            f"max_reserved_bytes is {format_bytes(quota)}")
    return problems


def test_every_job_spec_is_within_its_tenants_quota(variant):
    name, docs = variant
    assert quota_problems(docs) == [], name


def test_a_job_above_its_tenants_quota_is_caught():
    docs = docs_of(WHOLE_NODE)
    tenants = one(docs, "ConfigMap", "horizon-ray-config")
    tenants["data"] = one(base_docs(), "ConfigMap", "horizon-ray-config")["data"]  # the base's quotas: 480 GiB
    assert quota_problems(docs) == ["qwen2.5-72b-sft.yaml needs 1128.1 GiB of host RAM; tenant team-a's "
                                    "max_reserved_bytes is 480.0 GiB"]


# ---- the whole-node overlay: one pod per 8-GPU server, a job over all of its GPUs -------------------------

def whole_node_group(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The whole-node overlay's GPU group, its node shape and its sized-for job spec (planned form)."""
    group = next(g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"] if g.get("replicas"))
    annotations = group["template"]["metadata"]["annotations"]
    spec = planned_spec(one(docs, "ConfigMap", JOBS_CONFIGMAP)["data"][annotations[SIZED_FOR]])
    return group, json.loads(annotations[NODE_SHAPE]), spec


def test_the_whole_node_pod_holds_every_gpu_and_almost_all_of_its_node():
    group, shape, _ = whole_node_group(docs_of(WHOLE_NODE))
    gpus = int(quantity(shape["capacity"]["nvidia.com/gpu"]))
    assert gpus == 8 and shape["podsPerNode"] == 1
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert quantity(resources["requests"]["nvidia.com/gpu"]) == quantity(resources["limits"]["nvidia.com/gpu"]) \
        == gpus
    # what the node's allocatable resources leave beside the DaemonSets, less a little headroom
    for key in ("cpu", "memory"):
        free = quantity(shape["allocatable"][key]) - quantity(shape["daemonSets"][key])
        assert 0.98 * free <= quantity(resources["limits"][key]) <= free, key


def test_the_whole_node_job_asks_for_every_gpu_of_the_pod_and_fits_it():
    from dataclasses import replace

    from horizon_ray.planner import plan_for_spec

    docs = docs_of(WHOLE_NODE)
    group, _, spec = whole_node_group(docs)
    node = worker_node(group)
    assert spec["resources"]["gpus"] == node.gpus == 8
    assert spec["method"] == "full" and spec["model"]["path"] == "Qwen2.5-72B-Instruct"
    p = plan_for_spec(spec, node)
    assert p.fits and p.gpus == 8, p.reason
    assert p.tokens_per_step == 8 * 2048 * 4 * 8  # every rank runs grad_accum micro-batches of every step
    assert 1120 * GiB < p.host_bytes < 1135 * GiB  # 1128.1 GiB: one host copy, eight ranks' buffers
    assert 40 * GiB < p.gpu_bytes < 47 * GiB  # 41.7 GiB on each GPU
    # The count is what the planner checks: fewer GPUs than the job asks for do not hold it ...
    fewer = plan_for_spec(spec, replace(node, gpus=4))
    assert not fewer.fits and "resources.gpus" in fewer.reason, fewer.reason
    # ... and a per-GPU pod of the same server has neither the GPUs nor the RAM.
    per_gpu = worker_node(one(docs_of(PER_GPU), "RayCluster")["spec"]["workerGroupSpecs"][0])
    assert not plan_for_spec(spec, per_gpu).fits
    assert not plan_for_spec(spec, replace(per_gpu, gpus=8)).fits  # host RAM


def test_a_pod_with_fewer_gpus_than_its_job_fails_the_fit_check():
    docs = docs_of(WHOLE_NODE)
    group, _, _ = whole_node_group(docs)
    resources = group["template"]["spec"]["containers"][0]["resources"]
    resources["requests"]["nvidia.com/gpu"] = resources["limits"]["nvidia.com/gpu"] = "4"
    problems = fit_problems(docs)
    assert len(problems) == 1 and "qwen2.5-72b-sft.yaml does not fit" in problems[0], problems
    assert "asks for 8 GPUs (resources.gpus)" in problems[0], problems


def memory_mismatches(docs: list[dict[str, Any]]) -> list[str]:
    """Containers whose requests differ from their limits (memory and CPU, and GPUs)."""
    out = []
    for where, template in pod_templates(docs):
        for c in template["spec"]["containers"]:
            res = c.get("resources", {})
            req, lim = res.get("requests", {}), res.get("limits", {})
            if "memory" not in lim:
                out.append(f"{where} container {c['name']} has no memory limit")
            for key in set(req) | set(lim):
                if key in ("memory", "cpu", "nvidia.com/gpu") and quantity(req.get(key, 0)) != quantity(
                        lim.get(key, 0)):
                    out.append(f"{where} container {c['name']}: {key} requests {req.get(key)} != limits "
                               f"{lim.get(key)}")
    return out


def test_requests_equal_limits(variant):
    name, docs = variant
    assert memory_mismatches(docs) == [], name


def test_a_request_below_its_limit_is_caught():
    docs = base_docs()
    c = one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    c["resources"]["requests"]["memory"] = "64Gi"
    assert memory_mismatches(docs) == ["RayCluster horizon-ray group gpu-bigmem container ray-worker: memory "
                                       "requests 64Gi != limits 232Gi"]


def test_ray_takes_its_memory_and_gpus_from_the_limits(variant):
    _, docs = variant
    cluster = one(docs, "RayCluster")["spec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        params = group.get("rayStartParams", {})
        assert "memory" not in params, "KubeRay derives Ray's memory from the limit; do not override it"
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        if "num-gpus" in params:
            assert int(params["num-gpus"]) == int(limits.get("nvidia.com/gpu", 0))
    for group in cluster["workerGroupSpecs"]:
        c = group["template"]["spec"]["containers"][0]
        env = env_of(c)
        assert env["HORIZON_NODE_RAM_BYTES"] == {"resourceFieldRef": {"containerName": c["name"],
                                                                      "resource": "limits.memory"}}
        # the agent splits the pod's cores among its engines; a thread variable set here would be kept as is
        # for every engine, however many run (horizon_ray.cluster.agent)
        assert env["HORIZON_NODE_CPUS"] == {"resourceFieldRef": {"containerName": c["name"],
                                                                 "resource": "limits.cpu"}}
        assert not {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "HORIZON_RAY_OPTIMIZER_THREADS"} & set(env), group[
            "groupName"]


def test_job_specs_load_strictly(variant):
    from horizon_ray.jobspec import JobSpec

    _, docs = variant
    for key, text in one(docs, "ConfigMap", JOBS_CONFIGMAP)["data"].items():
        spec = JobSpec.from_dict(yaml.safe_load(text))
        assert key == f"{spec.name}.yaml"


# ---- the service's wiring ------------------------------------------------------------------------------


def mounts(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def volume_claim(template: dict[str, Any], mount: dict[str, Any]) -> str | None:
    vol = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    return vol.get("persistentVolumeClaim", {}).get("claimName")


def control_args(docs) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The parsed `horizon-ray serve` arguments of the head's control sidecar, its container, its template."""
    import argparse

    from horizon_ray.commands import serve

    template = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    c = container(template, "horizon-control")
    script = "\n".join(c.get("command", []) + c.get("args", []))
    line = next(line.strip() for line in script.splitlines() if line.strip().startswith("exec horizon-ray serve"))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(shlex.split(line)[3:]), c, template


def test_head_runs_the_coordinator_with_a_persistent_job_table(variant, tmp_path):
    _, docs = variant
    args, control, template = control_args(docs)
    head = container(template, "ray-head")
    root = str(args.root)
    assert args.no_api and args.address == "${MY_POD_IP}:6379"
    assert args.no_head_agent, "an agent on the head would take jobs there (no data volumes, beside the GCS)"
    assert env_of(control)["MY_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # The coordinator actor runs in ray-head and the serve driver in the sidecar: same state volume in both.
    state = one(docs, "PersistentVolumeClaim", "horizon-ray-state")
    for c in (head, control):
        assert volume_claim(template, mounts(c)[root]) == "horizon-ray-state", c["name"]
        assert "/tmp/ray" in mounts(c), "the sidecar reaches the head's raylet through /tmp/ray"
    # ... and a Ray driver finds the raylet of its node among the processes it sees
    assert template["spec"].get("shareProcessNamespace") is True, "the sidecar's driver cannot see the raylet"
    assert state["spec"]["accessModes"] == ["ReadWriteOnce"]
    # Only the head mounts the job table.
    for where, t in pod_templates(docs):
        if "head" not in where:
            assert all(volume_claim(t, m) != "horizon-ray-state" for c in t["spec"]["containers"]
                       for m in c.get("volumeMounts", [])), where
    # The tenants file is a mounted ConfigMap key and loads strictly.
    from horizon_ray.cluster.tenants import TenantsConfig

    tenants = Path(args.tenants)
    mount = mounts(control)[str(tenants.parent)]
    vol = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    text = one(docs, "ConfigMap", vol["configMap"]["name"])["data"][tenants.name]
    TenantsConfig.load(_write(tmp_path, "tenants.yaml", text))


def test_everything_the_coordinator_opens_is_mounted_where_it_runs(variant):
    """The coordinator is a Ray actor pinned to the head: Ray starts it in the Ray container (ray-head), not in
    the sidecar that asked for it. Every path it opens must be mounted there, at the path it is given."""
    _, docs = variant
    args, control, template = control_args(docs)
    head = container(template, "ray-head")
    api = env_of(container(one(docs, "Deployment", "horizon-ray-api")["spec"]["template"], "api"))
    opened = {
        "job table (--root)": str(args.root),
        "job outputs (<root>/jobs)": f"{args.root}/jobs",
        "tenants file (--tenants)": str(args.tenants),
        "models it plans from": api["HORIZON_MODEL_ROOTS"],
        "datasets it checks": api["HORIZON_DATA_ROOTS"],
    }
    missing = {what: path for what, path in opened.items()
               if not any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts(head))}
    assert not missing, f"ray-head does not mount what the coordinator opens: {missing}"
    # the same volume where both containers mount it (serve checks the tenants file before handing it over)
    both = set(mounts(head)) & set(mounts(control))
    assert {str(args.root), str(Path(args.tenants).parent)} <= both
    for path in both:
        assert mounts(head)[path]["name"] == mounts(control)[path]["name"], path


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def test_job_outputs_live_on_shared_storage_at_one_path(variant):
    name, docs = variant
    args, _, _ = control_args(docs)
    jobs_root = f"{args.root}/jobs"  # start_service: <root>/jobs
    api = container(one(docs, "Deployment", "horizon-ray-api")["spec"]["template"], "api")
    assert env_of(api)["HORIZON_JOBS_ROOT"] == jobs_root
    uploads = env_of(api)["HORIZON_UPLOADS_DIR"]
    # the coordinator (in ray-head), the engines (workers) and the API; the sidecar only starts the service
    readers = [(w, t, c) for w, t in pod_templates(docs) if w.startswith(("RayCluster", "Deployment"))
               for c in t["spec"]["containers"] if c["name"] != "horizon-control"]
    for where, template, c in readers:
        m = mounts(c).get(jobs_root)
        assert m and volume_claim(template, m) == "horizon-ray-shared" and m.get("subPath") == "jobs", \
            f"{where} {c['name']} does not mount the shared jobs/ at {jobs_root}"
        if "group" in where or where.startswith("Deployment"):
            u = mounts(c).get(uploads)
            assert u and volume_claim(template, u) == "horizon-ray-shared" and u.get("subPath") == "uploads", where
    assert not mounts(api)[uploads].get("readOnly"), "the API writes uploads"
    shared = one(docs, "PersistentVolumeClaim", "horizon-ray-shared")
    if name != "overlays/dev-cpu":  # a single-node dev cluster may use ReadWriteOnce
        assert shared["spec"]["accessModes"] == ["ReadWriteMany"], "jobs move between nodes"
    # Every sample job writes under the jobs root and reads what the workers mount.
    workers = [c for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
               for c in g["template"]["spec"]["containers"]]
    for key, text in one(docs, "ConfigMap", JOBS_CONFIGMAP)["data"].items():
        spec = yaml.safe_load(text)
        assert spec["output_dir"].startswith(jobs_root + "/"), key
        for path in (spec["model"]["path"], spec["data"]["path"]):
            for c in workers:
                assert any(path.startswith(p.rstrip("/") + "/") for p in mounts(c)), f"{key}: {path} on {c['name']}"


def test_api_is_a_service_with_health_probes(variant):
    _, docs = variant
    deployment = one(docs, "Deployment", "horizon-ray-api")
    template = deployment["spec"]["template"]
    web = container(template, "api")
    assert web["command"][:3] == ["uvicorn", "--factory", "api.app:app_from_env"]
    import importlib

    module, _, factory = web["command"][2].partition(":")
    assert callable(getattr(importlib.import_module(module), factory))
    port = next(p for p in web["ports"] if p["name"] == "http")
    assert web["command"][web["command"].index("--port") + 1] == str(port["containerPort"])
    assert web["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert web["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert web["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    service = one(docs, "Service", "horizon-ray-api")
    labels = template["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert any(p["targetPort"] == "http" for p in service["spec"]["ports"])
    # The Ray Client address points at the head Service KubeRay creates for the cluster.
    cluster = one(docs, "RayCluster")
    client = next(p for p in container(cluster["spec"]["headGroupSpec"]["template"], "ray-head")["ports"]
                  if p["name"] == "client")
    assert env_of(web)["HORIZON_RAY_ADDRESS"] == f"ray://{cluster['metadata']['name']}-head-svc:" \
                                                 f"{client['containerPort']}"


def test_api_settings_come_from_known_variables_and_keys_from_a_secret(variant, tmp_path):
    import api.settings as settings

    _, docs = variant
    template = one(docs, "Deployment", "horizon-ray-api")["spec"]["template"]
    api = container(template, "api")
    env = env_of(api)
    known = {s.env for s in settings.SETTINGS} | {"HORIZON_RAY_ADDRESS"}
    unknown = sorted(k for k in env if k.startswith("HORIZON_") and k not in known)
    assert not unknown, f"variables the API does not read: {unknown} (api/settings.py names {sorted(known)})"
    assert settings.ENV_KEYS not in env, "API keys belong in the Secret file, not in an environment variable"
    keys_file = Path(env[settings.ENV_KEYS_FILE])
    mount = mounts(api)[str(keys_file.parent)]
    secret_name = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])["secret"]["secretName"]
    # The operator creates the Secret: `kubectl apply -k` must never reset it to a placeholder.
    assert not [d for d in render(K8S / variant[0]) if d["kind"] == "Secret"], \
        "a kustomization that ships a Secret resets the keys to it on every apply"
    example = one(load_docs(K8S / "examples" / "api-keys.secret.yaml"), "Secret", secret_name)
    text = example["stringData"][keys_file.name]
    keys = settings.load_api_keys_file(_write(tmp_path, keys_file.name, text))
    with pytest.raises(ValueError, match="placeholder"):  # the example's key does not start an API
        settings.ApiSettings(api_keys=keys)
    settings.ApiSettings(api_keys={f"0f3c2d9e8b7a6f5e-{i}": tenant for i, tenant in enumerate(keys.values())})
    settings.ApiSettings.from_env({k: v for k, v in env.items() if isinstance(v, str) and k != settings.ENV_KEYS_FILE})


def test_rayjob_runs_finetune_on_a_mounted_spec_through_the_coordinator(variant):
    import argparse

    from horizon_ray.commands import finetune

    _, docs = variant
    cluster = one(docs, "RayCluster")
    job = one(docs, "RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["horizon-ray", "finetune"]
    parser = argparse.ArgumentParser()
    finetune.add_arguments(parser)
    config = Path(parser.parse_args(argv[2:]).config)
    head_template = cluster["spec"]["headGroupSpec"]["template"]
    mount = mounts(container(head_template, "ray-head"))[str(config.parent)]  # entrypoints run in ray-head
    vol = next(v for v in head_template["spec"]["volumes"] if v["name"] == mount["name"])
    assert vol["configMap"]["name"] == JOBS_CONFIGMAP
    assert config.name in one(docs, "ConfigMap", JOBS_CONFIGMAP)["data"]
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["HORIZON_RAY_SUBMIT"] == "1", "the entrypoint must hand the spec to the coordinator"
    # Some worker group's pods can hold the job the RayJob runs (else the coordinator rejects it).
    from horizon_ray.planner import plan_for_spec

    spec = planned_spec(one(docs, "ConfigMap", JOBS_CONFIGMAP)["data"][config.name])
    assert any(plan_for_spec(spec, worker_node(g)).fits for g in cluster["spec"]["workerGroupSpecs"])


def test_two_images_and_ray_versions_agree(variant):
    """The API runs the CPU-only image, every Ray pod the full one; Ray Client needs the same Ray on both."""
    _, docs = variant
    api = container(one(docs, "Deployment", "horizon-ray-api")["spec"]["template"], "api")
    assert api["image"] == API_IMAGE
    others = {c["image"] for c in _all_containers(docs) if c is not api}
    assert others == {IMAGE}
    dockerfile = (K8S / "Dockerfile").read_text()
    assert re.search(r"^FROM \S+ AS api$", dockerfile, re.M), "k8s/Dockerfile has no `api` target"
    ray_versions = set(re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M))
    assert ray_versions == {one(docs, "RayCluster")["spec"]["rayVersion"]}
    import horizon_ray

    assert IMAGE.rsplit(":", 1)[1] == API_IMAGE.rsplit(":", 1)[1] == horizon_ray.__version__


def test_the_api_image_installs_what_the_api_imports():
    """The `api` target installs a list of distributions instead of the project's dependencies (torch and its
    CUDA libraries are not needed to serve HTTP): every distribution `api.app` imports must be on it."""
    import importlib.metadata as md
    import subprocess
    import sys

    # what api.app imports, less what any interpreter loads at startup; Ray (imported when the client
    # connects) is on the list as ray[client]
    def top_modules(statement: str) -> set[str]:
        code = f"import sys; {statement}; print('\\n'.join({{m.split('.')[0] for m in sys.modules}}))"
        return set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=300, cwd=ROOT).stdout.split())

    owners = md.packages_distributions()
    needed = [{d.lower().replace("_", "-") for d in owners[m]}  # a namespace package has several owners
              for m in top_modules("import api.app") - top_modules("pass") if m in owners]
    # a module the project's own dependencies do not bring is one the API imports only when something else
    # installed it (anyio takes sniffio when the dev extras' openai brought it): not needed in the image
    runtime = _closure({"horizon-ray"})
    needed = [ds for ds in needed if "horizon-ray" not in ds and ds & runtime]
    dockerfile = (K8S / "Dockerfile").read_text()
    stage = dockerfile[dockerfile.index(" AS api"):dockerfile.index("\nFROM ", dockerfile.index(" AS api"))]
    listed = {m.group(1).lower() for m in re.finditer(r'"([A-Za-z0-9_.-]+)(?:\[[a-z,]+\])?[=<>]', stage)}
    assert "ray" in listed
    have = _closure(listed)
    missing = sorted(" or ".join(sorted(ds)) for ds in needed if not ds & have)
    assert not missing, f"the api image misses {missing}: add them to k8s/Dockerfile's api stage"
    assert not any("torch" in ds for ds in needed), "the API imports torch: the CPU-only image would not start"


def _closure(dists: set[str]) -> set[str]:
    """`dists` and everything they require, transitively (installed distributions only)."""
    import importlib.metadata as md

    seen, todo = set(), list(dists)
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.add(d)
        try:
            reqs = md.requires(d) or []
        except md.PackageNotFoundError:
            continue
        todo += [re.split(r"[ ;<>=!\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs
                 if "extra ==" not in r]
    return seen


# ---- what a real cluster checks: node sizes, security, networking --------------------------------------


def pod_requests(template: dict[str, Any]) -> dict[str, float]:
    """A pod's scheduling requests: its containers' summed, or its largest init container's if larger."""
    total: dict[str, float] = {}
    for c in template["spec"]["containers"]:
        for key, q in c.get("resources", {}).get("requests", {}).items():
            total[key] = total.get(key, 0.0) + quantity(q)
    for c in template["spec"].get("initContainers", []):
        for key, q in c.get("resources", {}).get("requests", {}).items():
            total[key] = max(total.get(key, 0.0), quantity(q))
    return total


def node_fit_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Worker groups whose pods, `podsPerNode` of them beside the DaemonSets, exceed the allocatable resources
    of the node shape they declare (annotation horizon-ray.io/node-shape). A shape `sharedWithTheRest` (a
    one-node dev cluster) holds the head and the API replicas too."""
    cluster = one(docs, "RayCluster")
    problems = []
    for group in cluster["spec"]["workerGroupSpecs"]:
        name = group["groupName"]
        raw = group["template"].get("metadata", {}).get("annotations", {}).get(NODE_SHAPE)
        if not raw:
            problems.append(f"worker group {name} declares no {NODE_SHAPE}: its pods' size is not derived from a node")
            continue
        shape = json.loads(raw)
        used = {k: quantity(v) for k, v in shape["daemonSets"].items()}
        pods = [group["template"]] * int(shape["podsPerNode"])
        if shape.get("sharedWithTheRest"):
            pods.append(cluster["spec"]["headGroupSpec"]["template"])
            api = one(docs, "Deployment", "horizon-ray-api")
            pods += [api["spec"]["template"]] * int(api["spec"].get("replicas", 1))
        for template in pods:
            for key, value in pod_requests(template).items():
                used[key] = used.get(key, 0.0) + value
        for key, value in used.items():
            allocatable = quantity(shape["allocatable"].get(key, 0))
            if value > allocatable:
                problems.append(f"worker group {name}: {key} {value:g} requested on a node with {allocatable:g} "
                                "allocatable")
        for key, cap in shape["capacity"].items():
            assert quantity(shape["allocatable"][key]) <= quantity(cap), f"{name}: allocatable above capacity"
    return problems


def test_pods_fit_the_allocatable_resources_of_their_nodes(variant):
    name, docs = variant
    assert node_fit_problems(docs) == [], name


def test_a_pod_too_big_for_its_node_is_caught():
    docs = docs_of(PER_GPU)
    c = one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    c["resources"]["requests"]["cpu"] = c["resources"]["limits"]["cpu"] = "24"  # 8 x 24 = 192 > 191.45
    assert node_fit_problems(docs) == ["worker group gpu-bigmem: cpu 194 requested on a node with 191.45 "
                                       "allocatable"]


def test_ray_token_authentication_reaches_every_client_of_ray(variant):
    _, docs = variant
    cluster = one(docs, "RayCluster")
    assert cluster["spec"]["authOptions"] == {"mode": "token"}
    assert TOKEN_SECRET[0] == cluster["metadata"]["name"], "KubeRay names the token Secret after the cluster"
    token = {"secretKeyRef": {"name": TOKEN_SECRET[0], "key": TOKEN_SECRET[1]}}
    # KubeRay puts RAY_AUTH_MODE/RAY_AUTH_TOKEN in the Ray container (the first) and the RayJob submitter;
    # every other container that talks to Ray gets them from the manifests.
    clients = [container(cluster["spec"]["headGroupSpec"]["template"], "horizon-control"),
               container(one(docs, "Deployment", "horizon-ray-api")["spec"]["template"], "api")]
    for c in clients:
        env = env_of(c)
        assert env.get("RAY_AUTH_MODE") == "token" and env.get("RAY_AUTH_TOKEN") == token, c["name"]
    job = one(docs, "RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}


def test_only_this_deployment_reaches_rays_ports(variant):
    _, docs = variant
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    ray = next(p for p in policies if p["spec"]["podSelector"].get("matchLabels") == {
        "ray.io/cluster": one(docs, "RayCluster")["metadata"]["name"]})
    assert ray["spec"]["policyTypes"] == ["Ingress"]
    ours = {"app.kubernetes.io/name": "horizon-ray"}
    peers = [peer for rule in ray["spec"]["ingress"] for peer in rule["from"]]
    assert {"podSelector": {"matchLabels": ours}} in peers
    for peer in peers:  # nothing opens Ray to any pod or address
        assert "ipBlock" not in peer and peer.get("podSelector", {}).get("matchLabels"), peer
    # every pod that talks to Ray carries the label the policy admits
    for where, template in pod_templates(docs):
        assert template["metadata"]["labels"].items() >= ours.items(), where


def test_pods_pass_the_restricted_pod_security_level(variant):
    """Pod Security Standards, level "restricted" (the parts a manifest controls)."""
    _, docs = variant
    for where, template in pod_templates(docs):
        spec = template["spec"]
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0, where
        assert pod.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"), where
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
        assert not any("hostPath" in v for v in spec.get("volumes", [])), where
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{where} {c['name']}"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{where} {c['name']}"
            assert not sc.get("privileged") and sc.get("runAsUser", 1) != 0, f"{where} {c['name']}"


def test_ray_containers_have_a_shared_memory_object_store(variant):
    _, docs = variant
    cluster = one(docs, "RayCluster")["spec"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        template = group["template"]
        mount = mounts(template["spec"]["containers"][0]).get("/dev/shm")
        assert mount, f"{group.get('groupName', 'head')}: no /dev/shm volume for the object store"
        vol = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])["emptyDir"]
        store = quantity(group["rayStartParams"]["object-store-memory"])
        assert vol["medium"] == "Memory" and store <= quantity(vol["sizeLimit"]), group.get("groupName", "head")


def test_worker_pods_checkpoint_before_they_stop(variant):
    import argparse

    from horizon_ray.commands import drain

    _, docs = variant
    for group in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        c = spec["containers"][0]
        argv = c["lifecycle"]["preStop"]["exec"]["command"]
        assert argv[:2] == ["horizon-ray", "drain"], group["groupName"]
        parser = argparse.ArgumentParser()
        drain.add_arguments(parser)
        timeout = parser.parse_args(argv[2:]).timeout
        # the grace period covers the hook and leaves Ray time to stop after SIGTERM
        assert spec["terminationGracePeriodSeconds"] >= timeout + 30, group["groupName"]
        if "nvidia.com/gpu" in c["resources"]["limits"]:
            caps = set(env_of(c)["NVIDIA_DRIVER_CAPABILITIES"].split(","))
            assert {"compute", "utility"} <= caps, "CUDA needs compute, nvidia-smi utility"


def test_head_and_api_stay_off_gpu_nodes(variant):
    _, docs = variant
    off_gpu = {"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]}
    for template in (one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"],
                     one(docs, "Deployment", "horizon-ray-api")["spec"]["template"]):
        terms = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert terms and all(off_gpu in t["matchExpressions"] for t in terms)


def test_the_shared_volume_names_its_storage_class(variant):
    name, docs = variant
    shared = one(docs, "PersistentVolumeClaim", "horizon-ray-shared")["spec"]
    if shared["accessModes"] == ["ReadWriteMany"]:
        # the default class of most clouds is block storage, on which a ReadWriteMany claim stays Pending
        assert shared.get("storageClassName"), f"{name}: the ReadWriteMany claim names no storage class"
    else:
        assert name == "overlays/dev-cpu", f"{name}: only a one-node dev cluster may share a ReadWriteOnce volume"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed; the renderer is "
                                                            "compared with `kubectl kustomize` only where it is")
@pytest.mark.parametrize("name", VARIANTS)
def test_renderer_matches_kubectl_kustomize(name):
    out = subprocess.run(["kubectl", "kustomize", str(K8S / name)], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(out), key=key) == sorted(render(K8S / name), key=key)


def test_the_coordinators_gate_checks_what_the_api_checks(variant):
    """The head's control sidecar hands the coordinator its gate (horizon_ray/cluster/gate.py): the digests of
    the same keys file as the API's (the API's credential is derived from it) and the same roots, so that a
    path the API refuses is refused to a Ray job too. The keys are not mounted where Ray Jobs run."""
    _, docs = variant
    _, control, template = control_args(docs)
    api_template = one(docs, "Deployment", "horizon-ray-api")["spec"]["template"]
    api = container(api_template, "api")
    gate_vars = ("HORIZON_API_KEYS_FILE", "HORIZON_UPLOADS_DIR", "HORIZON_JOBS_ROOT", "HORIZON_MODEL_ROOTS",
                 "HORIZON_DATA_ROOTS", "HORIZON_MODEL_CATALOGUE")
    assert {v: env_of(control).get(v) for v in gate_vars} == {v: env_of(api)[v] for v in gate_vars}

    def secret_at(t, c, path):
        found = [m for p, m in mounts(c).items() if path.startswith(p.rstrip("/") + "/")]
        assert found, f"{c['name']} does not mount {path}"
        return next(v for v in t["spec"]["volumes"] if v["name"] == found[0]["name"]).get("secret")

    keys = env_of(api)["HORIZON_API_KEYS_FILE"]
    assert secret_at(template, control, keys) == secret_at(api_template, api, keys) is not None
    head = container(template, "ray-head")
    assert not any(keys.startswith(p.rstrip("/") + "/") for p in mounts(head)), "Ray Jobs would read every key"
    for root in ("HORIZON_MODEL_ROOTS", "HORIZON_DATA_ROOTS", "HORIZON_UPLOADS_DIR", "HORIZON_JOBS_ROOT"):
        assert env_of(api)[root] in mounts(control), f"the gate cannot check {root} it does not see"
    # the RayJob declares its tenant by a key, filled in when applied, never a tenant name
    env = yaml.safe_load(one(docs, "RayJob")["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["HORIZON_API_KEY"] == "${TEAM_A_KEY}" and "HORIZON_RAY_TENANT" not in env


def test_no_pod_holds_a_service_account_token(variant):
    _, docs = variant
    for where, template in pod_templates(docs):
        assert template["spec"].get("automountServiceAccountToken") is False, where


def test_the_internet_facing_api_has_a_read_only_root(variant):
    _, docs = variant
    template = one(docs, "Deployment", "horizon-ray-api")["spec"]["template"]
    api = container(template, "api")
    assert api["securityContext"].get("readOnlyRootFilesystem") is True
    tmp = mounts(api)["/tmp"]
    assert "emptyDir" in next(v for v in template["spec"]["volumes"] if v["name"] == tmp["name"])


def test_egress_reaches_this_deployment_and_dns_only(variant):
    """No pod of ours reaches a metadata address, a tenant's URL or the internet; the KubeRay operator reaches
    Ray's ports from its own namespace only."""
    _, docs = variant
    ours = {"app.kubernetes.io/name": "horizon-ray"}
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    egress = [p for p in policies if "Egress" in p["spec"]["policyTypes"]]
    assert [p["spec"]["podSelector"] for p in egress] == [{"matchLabels": ours}]
    for rule in egress[0]["spec"]["egress"]:
        for peer in rule["to"]:
            assert "ipBlock" not in peer, peer
            if peer.get("namespaceSelector") is not None:  # the cluster's DNS, on port 53 only
                assert peer["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
                assert {p["port"] for p in rule["ports"]} == {53}
            else:
                assert peer == {"podSelector": {"matchLabels": ours}}
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    assert peer["namespaceSelector"].get("matchLabels"), f"{policy['metadata']['name']}: any namespace"
