"""An in-process testbed of the API: roots with a few model directories and a dataset, the coordinator's
in-process twin (``horizon_ray.cluster.fake``) with fake node agents, and settings with one key per tenant.

    bed = make_testbed(tmp_path)
    app = create_app(bed.client, bed.settings)
    with running_server(app) as url:
        httpx.post(f"{url}/finetune", json=bed.spec(), headers=bed.auth("acme"))

The fake planner reads a model's host RAM from its directory name: ``1GiB`` fits every node,
``1TiB`` none. Fake agents train one step per coordinator tick and report loss 1/step. The per-tenant request
rate is not limited here (tests poll as fast as they like); pass ``rate_limit_per_s`` to turn it on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.settings import ApiSettings
from horizon_ray.cluster.client import LocalClient
from horizon_ray.cluster.fake import FakeAgent, FakeCoordinator, make_local_client

MODELS = ("1GiB", "8GiB", "1TiB")  # directories under the model root
DATASET = "demo.jsonl"  # a file under the data root
DEFAULT_TENANTS = ("acme", "globex")


@dataclass
class Testbed:
    root: Path  # everything lives under here
    client: LocalClient  # the coordinator's in-process twin
    settings: ApiSettings  # keys, roots, limits
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> API key

    __test__ = False  # not a pytest test class

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def spec(self, model: str = "1GiB", data: str = DATASET, **training: Any) -> dict[str, Any]:
        """A small valid job spec; keyword arguments go to `training`."""
        return {"model": {"path": model}, "data": {"path": data},
                "training": {"max_steps": 5, "seq_len": 64, **training}}

    def agent(self, node_id: str) -> FakeAgent:
        coordinator = self.client.coordinator
        assert isinstance(coordinator, FakeCoordinator), "make_testbed's coordinator drives FakeAgents"
        return coordinator.fake_agents[node_id]

    def close(self) -> None:
        self.client.close()


def make_testbed(
    root: str | Path,
    *,
    nodes: dict[str, str] | None = None,
    tenants: tuple[str, ...] = DEFAULT_TENANTS,
    quotas: dict | None = None,
    **settings_overrides: Any,
) -> Testbed:
    """A fresh testbed under `root`; `quotas` is a tenants-file mapping ({"default": ..., "tenants": ...})."""
    root = Path(root)
    models = root / "models"
    for name in MODELS:
        (models / name).mkdir(parents=True, exist_ok=True)
        (models / name / "config.json").write_text(json.dumps({"model_type": "llama"}))
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / DATASET).write_text("".join(
        json.dumps({"instruction": f"add {i} and {i}", "output": str(2 * i)}) + "\n" for i in range(16)))
    client = make_local_client(root / "coordinator", nodes=nodes or {"a": "16GiB", "b": "64GiB"},
                               tenants=quotas)
    keys = {t: f"key-{t}" for t in tenants}
    kwargs: dict[str, Any] = dict(
        api_keys={k: t for t, k in keys.items()},
        uploads_dir=root / "uploads",
        jobs_root=client.coordinator.jobs_root,
        data_roots=[data],
        model_roots=[models],
        sse_poll_s=0.05,
        rate_limit_per_s=0,
    )
    kwargs.update(settings_overrides)
    return Testbed(root=root, client=client, settings=ApiSettings(**kwargs), keys=keys)
