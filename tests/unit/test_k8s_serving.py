"""k8s/serving/rayservice-vllm.yaml: a KubeRay RayService serving job outputs with vLLM through Ray Serve LLM,
checked offline as the other manifests are (tests/unit/test_k8s.py): the RayService against KubeRay v1.7.0's
CRD schema made strict, its pod templates against Kubernetes' PodTemplate schema; requests equal limits; the
Serve config names Ray Serve LLM's builder and fields, and every model path lies on the shared volume the
service writes job outputs to (k8s/base), mounted read-only where Serve runs."""

from pathlib import Path

import yaml

from tests.unit.test_k8s import K8S, core_errors, crd_errors, one, render, template_as_pod_template

MANIFEST = K8S / "serving" / "rayservice-vllm.yaml"
LLM_CONFIG_KEYS = {"model_loading_config", "accelerator_type", "engine_kwargs", "deployment_config", "lora_config"}


def _service():
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    assert [d["kind"] for d in docs] == ["RayService"]
    return docs[0]


def _templates(svc):
    cluster = svc["spec"]["rayClusterConfig"]
    return [("head", cluster["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in cluster["workerGroupSpecs"]]


def test_the_rayservice_matches_the_crd_and_core_schemas():
    svc = _service()
    assert crd_errors(svc) == []
    for where, template in _templates(svc):
        assert core_errors(template_as_pod_template(f"RayService {where}", template)) == []


def test_a_planted_typo_fails_the_schema():
    svc = _service()
    svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 1
    assert crd_errors(svc)


def test_requests_equal_limits():
    for where, template in _templates(_service()):
        for c in template["spec"]["containers"]:
            assert c["resources"]["requests"] == c["resources"]["limits"], where


def test_serve_config_serves_job_outputs_from_the_shared_volume():
    svc = _service()
    apps = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
    assert [a["import_path"] for a in apps] == ["ray.serve.llm:build_openai_app"]
    configs = apps[0]["args"]["llm_configs"]
    assert all(set(c) <= LLM_CONFIG_KEYS for c in configs)
    sources = [c["model_loading_config"]["model_source"] for c in configs]
    lora_paths = [c["lora_config"]["dynamic_lora_loading_path"] for c in configs if "lora_config" in c]
    assert any(s.endswith("/final") for s in sources) and lora_paths
    assert all(c["engine_kwargs"].get("enable_lora") for c in configs if "lora_config" in c)
    # the PVC the service writes jobs to, under the same subPaths, read-only, in every Serve pod
    base = render(K8S / "base")
    one(base, "PersistentVolumeClaim", "horizon-ray-shared")
    for where, template in _templates(svc):
        mounts = {m["mountPath"]: m for c in template["spec"]["containers"] for m in c.get("volumeMounts", [])}
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]
                  if "persistentVolumeClaim" in v}
        for path in sources + lora_paths:
            mount = next((m for p, m in mounts.items() if Path(path).is_relative_to(p)), None)
            assert mount is not None, f"{where}: {path} is on no mount"
            assert claims[mount["name"]] == "horizon-ray-shared" and mount.get("readOnly"), where
            assert mount["subPath"] in ("jobs", "models"), where
