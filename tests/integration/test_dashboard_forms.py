"""The dashboard's new-job form and downloads in a real browser (Debian chromium driven by playwright) against a
real uvicorn: upload a dataset, pick a catalogue model, read the planner's verdict (compact, every node's), submit,
follow the job, download its files and final.tar with the key (a plain link carries no Bearer header), and read
the loss chart's legend."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from api.app import create_app
from api.server import running_server
from api.testing import make_testbed
from tests.integration.test_dashboard_browser import browser  # noqa: F401 - the fixture

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def served(tmp_path):
    bed = make_testbed(tmp_path / "bed")
    bed.settings.model_catalogue = {"tiny-1g": bed.root / "models" / "1GiB", "huge": bed.root / "models" / "1TiB"}
    bed.client.start_background(0.1)
    try:
        with running_server(create_app(bed.client, bed.settings)) as url:
            yield bed, url
    finally:
        bed.close()


def test_upload_plan_submit_and_download_from_the_dashboard(browser, served, tmp_path):  # noqa: F811
    expect = pytest.importorskip("playwright.sync_api").expect
    bed, url = served
    page = browser.new_page(viewport={"width": 1280, "height": 1100}, accept_downloads=True)
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    console_errors: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    page.fill("#api-key", bed.keys["acme"])
    page.click("#save-key")

    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(12)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    page.set_input_files("#upload-file", str(data))
    page.click("#upload-button")
    expect(page.locator("#upload-result")).to_contain_text("12 examples, sharegpt")
    file_id = page.text_content("#upload-result").split()[1].rstrip(":")
    assert file_id.startswith("file-")
    expect(page.locator("#f-data")).to_have_value(file_id)
    assert sorted(page.locator("#f-model option").all_text_contents()) == ["huge", "tiny-1g"]

    page.select_option("#f-model", "huge")
    page.click("#form-plan")
    expect(page.locator("#plan-verdict")).to_have_class("verdict reject")
    assert page.locator("#plan-nodes li").count() == 2
    assert all("does not fit" in t for t in page.locator("#plan-nodes li").all_text_contents())

    page.select_option("#f-model", "tiny-1g")
    page.fill("#f-max-steps", "6")
    page.fill("#f-seq-len", "64")
    page.fill("#f-name", "from the form")
    page.click("#form-plan")
    expect(page.locator("#plan-verdict")).to_contain_text("runs now on node")
    assert page.locator("#plan-view").bounding_box()["height"] < 200  # a verdict, not a JSON dump
    # the job trains only once its files are written: the page lists a job's outputs again when its status or
    # step moves, so a job that had finished before they were written would never show them
    agents = bed.client.coordinator.fake_agents.values()
    for agent in agents:
        agent.auto = False
    page.click("#form-submit")
    expect(page.locator("#form-result")).to_contain_text("submitted job-")
    job_id = page.text_content("#form-result").split()[1]
    record = bed.client.get("acme", job_id)
    assert record.spec["training"]["max_steps"] == 6 and record.name == "from the form"
    assert record.spec["data"]["path"].endswith(f"{file_id}.jsonl")

    out = Path(record.output_dir)
    (out / "final").mkdir(parents=True, exist_ok=True)
    (out / "final" / "config.json").write_text('{"model_type": "llama"}')
    (out / "metrics.jsonl").write_text('{"type": "metrics", "step": 1, "loss": 1.0}\n')
    (out / ".lock").write_text("")
    for agent in agents:
        agent.auto = True
    page.wait_for_selector(f"#jobs tbody tr[data-job-id='{job_id}'][data-status='succeeded']", timeout=60_000)
    page.wait_for_selector("#outputs tbody tr[data-path='metrics.jsonl']", timeout=30_000)
    assert sorted(page.locator("#outputs tbody td.id").all_text_contents()) == ["final/config.json", "metrics.jsonl"]
    with page.expect_download() as info:
        page.click("#outputs tbody tr[data-path='metrics.jsonl'] button.download")
    saved = tmp_path / "metrics.jsonl"
    info.value.save_as(saved)
    assert info.value.suggested_filename == "metrics.jsonl"
    assert saved.read_bytes() == (out / "metrics.jsonl").read_bytes()
    expect(page.locator("#download-final")).to_be_visible()
    with page.expect_download() as info:
        page.click("#download-final")
    tar = tmp_path / "final.tar"
    info.value.save_as(tar)
    assert info.value.suggested_filename == f"{job_id}-final.tar"
    with tarfile.open(fileobj=io.BytesIO(tar.read_bytes())) as archive:
        assert archive.extractfile(f"{job_id}-final/config.json").read() == b'{"model_type": "llama"}'

    legend = page.text_content("#chart-legend")
    assert "training loss" in legend and "eval loss" in legend
    page.screenshot(path=str(tmp_path / "dashboard-form.png"), full_page=True)
    assert all(u.startswith(url) or u.startswith("blob:") for u in requested), requested
    assert not console_errors, console_errors
