"""`horizon-ray serve` as the KubeRay head's sidecar runs it: joined cluster, no agent on the head, a tenants
file mounted from a ConfigMap."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from horizon_ray.commands import serve


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def kubelet_configmap(directory: Path, files: dict[str, str], stamp: str) -> None:
    """A ConfigMap volume as the kubelet writes it: <key> -> ..data/<key>, ..data -> ..<stamp>/; an edit of
    the ConfigMap writes a new ..<stamp>/, swaps ..data and deletes the old folder."""
    new = directory / f"..{stamp}"
    new.mkdir(parents=True)
    for name, text in files.items():
        (new / name).write_text(text)
    tmp = directory / "..data_tmp"
    tmp.symlink_to(new.name)
    old = (directory / "..data").resolve() if (directory / "..data").exists() else None
    os.replace(tmp, directory / "..data")
    for name in files:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    if old is not None:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()


def test_the_coordinator_gets_the_configmap_path_not_its_timestamped_target(tmp_path, monkeypatch):
    from horizon_ray.cluster import client, local
    from horizon_ray.cluster.tenants import TenantsConfig

    config = tmp_path / "config"
    kubelet_configmap(config, {"tenants.yaml": "tenants:\n  team-a: {max_concurrent_jobs: 4}\n"}, "2026_01_01_1")
    seen = {}

    def start_service(root, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt  # serve stops here, as on Ctrl-C

    monkeypatch.setenv("HORIZON_API_KEYS", "k-3f9a0c7e51d2b8a4=team-a")  # the coordinator's gate checks the keys
    monkeypatch.setattr(client, "connect_ray", lambda *a, **k: None)
    monkeypatch.setattr(local, "start_service", start_service)
    args = parse("--address", "127.0.0.1:6379", "--no-api", "--no-head-agent", "--root", str(tmp_path / "state"),
                 "--tenants", str(config / "tenants.yaml"))
    assert serve.run(args) == 0
    assert seen["skip_head"] is True
    given = Path(seen["tenants_file"])
    assert given == config / "tenants.yaml"
    # An edit of the ConfigMap: the coordinator, restarted by Ray later, still opens the file (a resolved
    # path pointed into the folder the kubelet has just deleted) and sees the new quotas.
    kubelet_configmap(config, {"tenants.yaml": "tenants:\n  team-a: {max_concurrent_jobs: 7}\n"}, "2026_01_02_1")
    assert TenantsConfig.load(given).quota("team-a").max_concurrent_jobs == 7


def test_no_head_agent_needs_a_joined_cluster(tmp_path):
    with pytest.raises(ValueError, match="--no-head-agent is for a joined cluster: add --address"):
        serve.run(parse("--no-head-agent", "--simulate-nodes", "a=16GiB", "--root", str(tmp_path)))
