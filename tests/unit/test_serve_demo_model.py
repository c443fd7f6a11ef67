"""`horizon-ray serve` offers the embedded demo model: the README's REST and OpenAI snippets name it as they stand.

Checked without a cluster: the settings serve builds (catalogue, model and data roots) confine the README's
specs as the API does (`api.paths.confine_spec`), and the README names the model serve offers.
"""

from __future__ import annotations

import json
import re

import pytest

from api.errors import ApiError
from api.paths import PathPolicy, confine_spec
from api.settings import ApiSettings
from horizon_ray.commands.serve import with_demo_model
from horizon_ray.commands.submit import local_spec
from horizon_ray.job.demo import DEMO_MODEL_NAME, prepare_demo_assets
from tests.serving import ROOT


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HORIZON_RAY_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _readme_curl_spec() -> dict:
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("curl ")
                and "/finetune" in line)
    return json.loads(re.search(r"-d '(\{.*?\})'", line).group(1))


def test_serve_offers_the_demo_model_and_its_data_for_the_readme_specs(home, tmp_path):
    settings = ApiSettings(api_keys={"k": "me"}, uploads_dir=tmp_path / "up", jobs_root=tmp_path / "jobs")
    with pytest.raises(ApiError) as refused:  # the settings the issue met: no roots, no catalogue
        confine_spec(_readme_curl_spec(), PathPolicy(settings, "me"))
    assert refused.value.status == 422

    offered = with_demo_model(settings)
    assets, built = prepare_demo_assets()
    assert not built  # with_demo_model built them into $HORIZON_RAY_HOME/demo
    assert assets.root.is_relative_to(home)
    assert offered.model_catalogue == {DEMO_MODEL_NAME: assets.model_dir.resolve()}
    assert offered.model_roots == [assets.root.resolve()] and offered.data_roots == [assets.root.resolve()]
    policy = PathPolicy(offered, "me")
    curl = confine_spec(_readme_curl_spec(), policy)
    assert curl["model"]["path"] == str(assets.model_dir.resolve())
    assert curl["data"] == {"path": str(assets.train_path.resolve()), "eval_path": str(assets.eval_path.resolve())}
    # examples/demo.yaml as `submit` hands it over (paths expanded on this machine), output_dir left to the service
    demo = local_spec(ROOT / "examples" / "demo.yaml")
    demo.pop("output_dir")
    confined = confine_spec(demo, policy)
    assert confined["model"]["path"] == str(assets.model_dir.resolve())
    assert confined["data"]["eval_path"] == str(assets.eval_path.resolve())


def test_an_operator_catalogue_keeps_its_entries_and_may_take_the_demo_name(home, tmp_path):
    models = tmp_path / "models"
    (models / "mine").mkdir(parents=True)
    settings = ApiSettings(api_keys={"k": "me"}, uploads_dir=tmp_path / "up", jobs_root=tmp_path / "jobs",
                           model_roots=[models], model_catalogue={"mine": models / "mine",
                                                                  DEMO_MODEL_NAME: models / "mine"})
    offered = with_demo_model(settings)
    mine = (models / "mine").resolve()
    assert offered.model_catalogue == {"mine": mine, DEMO_MODEL_NAME: mine}
    assert offered.model_roots[0] == models.resolve() and len(offered.model_roots) == 2


def test_the_readme_openai_snippet_names_the_model_serve_offers():
    text = (ROOT / "README.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "fine_tuning.jobs.create" in b)
    assert f'model="{DEMO_MODEL_NAME}"' in snippet
    for var in ("HORIZON_MODEL_ROOTS", "HORIZON_MODEL_CATALOGUE", "HORIZON_DATA_ROOTS", "--no-demo-model"):
        assert f"`{var}`" in text


def test_a_job_on_the_demo_model_keeps_the_operators_name_for_it(home, tmp_path):
    from api.openai import model_name
    from horizon_ray.cluster.messages import JobRecord, JobStatus

    assets, _ = prepare_demo_assets()
    settings = ApiSettings(api_keys={"k": "me"}, uploads_dir=tmp_path / "up", jobs_root=tmp_path / "jobs",
                           model_roots=[assets.root], model_catalogue={"tiny-demo": assets.model_dir})
    offered = with_demo_model(settings)
    assert list(offered.model_catalogue) == ["tiny-demo", DEMO_MODEL_NAME]
    record = JobRecord(id="job-0", tenant="me", name=None, status=JobStatus.QUEUED, priority=0, created_at=0.0,
                       spec={"model": {"path": str(assets.model_dir.resolve())}})
    assert model_name(record, offered.model_catalogue) == "tiny-demo"
