"""The dashboard's "try it" box in a real browser (Debian chromium driven by playwright) against a real uvicorn:
a succeeded job's panel offers a prompt; what comes back, streamed from /v1/chat/completions, is the engine's
answer to it. A job still running shows no box."""

import shutil

import httpx
import pytest

from api.app import create_app
from api.server import running_server
from api.testing import make_testbed
from horizon_ray.engine.generate import Generator
from horizon_ray.engine.sampling import Request, SamplingParams
from tests.integration.test_dashboard_browser import browser  # noqa: F401 (the fixture)
from tests.integration.test_openai_sdk import wait_for
from tests.tiny import catalogue_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def served(tmp_path):
    bed = make_testbed(tmp_path / "bed")
    catalogue_model(bed)
    bed.client.start_background(0.1)
    try:
        with running_server(create_app(bed.client, bed.settings)) as url:
            yield bed, url
    finally:
        bed.close()


def test_a_succeeded_job_can_be_tried_from_its_panel(browser, served):  # noqa: F811
    expect = pytest.importorskip("playwright.sync_api").expect
    bed, url = served
    job = httpx.post(f"{url}/finetune", json={**bed.spec(), "name": "tried"}, headers=bed.auth("acme")).json()
    wait_for(lambda: bed.client.get("acme", job["id"]).status.value == "succeeded")
    out = bed.client.get("acme", job["id"]).output_dir
    final = shutil.copytree(bed.settings.model_catalogue["tiny-1g"], f"{out}/final")  # as the runner writes it
    running = httpx.post(f"{url}/finetune", json=bed.spec(max_steps=100_000), headers=bed.auth("acme")).json()

    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    page.goto(url)
    page.fill("#api-key", bed.keys["acme"])
    page.click("#save-key")
    page.click(f"#jobs tbody tr[data-job-id='{running['id']}']")
    page.wait_for_selector("#job-section:not([hidden])")
    assert page.locator("#try-box").is_hidden()

    page.click(f"#jobs tbody tr[data-job-id='{job['id']}']")
    page.wait_for_selector("#try-box:not([hidden])")
    expect(page.locator("#try-model")).to_contain_text(f"ft:tiny-1g:acme:tried:{job['id']}")
    page.fill("#try-input", "add 2 and 3")
    page.click("#try-button")
    page.wait_for_selector("#try-output[data-state='done']", timeout=60_000)
    gen = Generator.from_pretrained(final, device="cpu")
    want = gen.generate([Request(gen.chat_prompt([{"role": "user", "content": "add 2 and 3"}]),
                                 SamplingParams(max_tokens=128))])[0].text
    assert page.text_content("#try-output") == want
    httpx.post(f"{url}/finetune/{running['id']}/cancel", headers=bed.auth("acme"))
