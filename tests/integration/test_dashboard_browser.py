"""The dashboard in a real browser (Debian chromium driven by playwright) against a real uvicorn: it asks for
an API key, shows the nodes with their RAM ledger and the jobs, follows a job to succeeded and draws its
loss curve. The run leaves a screenshot in the pytest tmp dir and in tests/artifacts/."""

import json
import shutil
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.server import running_server
from api.testing import make_testbed

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
STEPS = 30


@pytest.fixture
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def served(tmp_path):
    bed = make_testbed(tmp_path / "bed")
    bed.client.start_background(0.1)  # the cluster moves on its own, as the real coordinator does
    try:
        with running_server(create_app(bed.client, bed.settings)) as url:
            yield bed, url
    finally:
        bed.close()


def test_dashboard_follows_a_job_to_succeeded_and_draws_its_loss_curve(browser, served, tmp_path):
    expect = pytest.importorskip("playwright.sync_api").expect
    bed, url = served
    # A job that holds still on its node until the page is watching it.
    spec = {**bed.spec(max_steps=STEPS), "name": "browser run"}
    job = httpx.post(f"{url}/finetune", json=spec, headers=bed.auth("acme")).json()
    bed.agent(job["node_id"]).hold(job["id"])
    other = httpx.post(f"{url}/finetune", json=bed.spec(max_steps=100_000), headers=bed.auth("globex")).json()

    page = browser.new_page(viewport={"width": 1280, "height": 1100})
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    console_errors: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    page.goto(url)

    # No key yet: the page asks for one.
    page.wait_for_selector("#banner:not([hidden])")
    assert "API key" in page.text_content("#banner")
    page.fill("#api-key", "wrong")
    page.click("#save-key")
    # A locator wait, not wait_for_function: the page's CSP (script-src 'self') forbids the eval that a
    # string predicate falls back to once its first check comes back false.
    expect(page.locator("#banner")).to_contain_text("refused")
    page.fill("#api-key", bed.keys["acme"])
    page.click("#save-key")

    row = f"#jobs tbody tr[data-job-id='{job['id']}']"
    page.wait_for_selector(f"{row}[data-status='running']")
    assert page.text_content(f"{row} td:nth-child(2)") == "browser run"
    # Nodes with their RAM ledger: acme's job is its own segment; globex's is anonymous.
    page.wait_for_selector("#nodes tbody tr[data-node-id='a']")
    assert page.locator("#nodes tbody tr").count() == 2
    assert page.locator("#nodes .bar .mine").count() == 1
    assert page.locator("#nodes .bar .other").count() == 1
    assert other["id"] not in page.text_content("#nodes")
    assert other["id"] not in page.text_content("#jobs")

    page.click(row)
    page.wait_for_selector("#job-section:not([hidden])")
    bed.agent(job["node_id"]).hold(job["id"], False)

    page.wait_for_selector(f"{row}[data-status='succeeded']", timeout=60_000)
    page.wait_for_selector(f"#loss-line[data-points='{STEPS}']", timeout=60_000)
    page.wait_for_selector("#job-status.status-succeeded")
    assert page.text_content(f"{row} td.status") == "succeeded"
    assert page.text_content(f"{row} td.progress").strip().endswith(f"{STEPS}/{STEPS}")
    # The curve falls as the fake engine's loss (1/step) does: the last point sits lowest.
    d = page.get_attribute("#loss-line", "d")
    ys = [float(p.split(",")[1]) for p in d.replace("M", "").split(" L")]
    assert len(ys) == STEPS and ys[-1] > ys[0]  # SVG y grows downwards
    events = page.locator("#events li")
    assert events.first.text_content().startswith("status")
    assert "succeeded" in events.last.text_content()

    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, ARTIFACTS / "dashboard.png")
    assert shot.stat().st_size > 10_000

    # The key stays in this browser: a reload shows the jobs without asking again.
    page.reload()
    page.wait_for_selector(f"{row}[data-status='succeeded']")
    assert page.evaluate("localStorage.getItem('horizon.apiKey')") == bed.keys["acme"]

    assert all(u.startswith(url) for u in requested), [u for u in requested if not u.startswith(url)]
    assert not [e for e in console_errors if "401" not in e], console_errors
    httpx.post(f"{url}/finetune/{other['id']}/cancel", headers=bed.auth("globex"))


def test_a_dpo_jobs_page_shows_its_rewards_as_the_loss_is_shown(browser, served):
    """A DPO job's panel: TRL's reward metrics of every step drawn as curves beside the loss, the latest in the
    facts and each step's accuracy and margin in its event line; an SFT job's panel has no reward chart."""
    from horizon_ray.cluster.fake import fake_rewards

    expect = pytest.importorskip("playwright.sync_api").expect
    bed, url = served
    steps = 12
    pairs = [{"prompt": f"add {i} and {i}", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(8)]
    (bed.root / "data" / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    spec = {**bed.spec(data="prefs.jsonl", max_steps=steps), "objective": "dpo", "dpo": {"beta": 0.2}}
    dpo = httpx.post(f"{url}/finetune", json=spec, headers=bed.auth("acme"))
    assert dpo.status_code == 201, dpo.text
    dpo = dpo.json()
    sft = httpx.post(f"{url}/finetune", json=bed.spec(max_steps=3), headers=bed.auth("acme")).json()

    page = browser.new_page(viewport={"width": 1280, "height": 1400})
    console_errors: list[str] = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    page.fill("#api-key", bed.keys["acme"])
    page.click("#save-key")
    for job in (dpo, sft):
        page.wait_for_selector(f"#jobs tbody tr[data-job-id='{job['id']}'][data-status='succeeded']", timeout=60_000)

    page.click(f"#jobs tbody tr[data-job-id='{sft['id']}']")
    page.wait_for_selector("#loss-line[data-points='3']")
    assert page.locator("#reward-section").is_hidden()
    assert "rewards/" not in page.text_content("#job-facts")

    page.click(f"#jobs tbody tr[data-job-id='{dpo['id']}']")
    page.wait_for_selector("#reward-section:not([hidden])")
    last = fake_rewards(steps, steps)
    for name, line in (("rewards/chosen", "#reward-chosen-line"), ("rewards/rejected", "#reward-rejected-line"),
                       ("rewards/margins", "#reward-margins-line"), ("rewards/accuracies", "#reward-accuracies-line")):
        page.wait_for_selector(f"{line}[data-points='{steps}']")
        ys = [float(p.split(",")[1]) for p in page.get_attribute(line, "d").replace("M", "").split(" L")]
        # chosen, margins and accuracies rise each step (SVG y grows downwards), rejected falls
        assert all((b > a) if name == "rewards/rejected" else (b < a) for a, b in zip(ys, ys[1:])), (name, ys)
    page.wait_for_selector(f"#loss-line[data-points='{steps}']")
    expect(page.locator("#job-facts")).to_contain_text("rewards/accuracies")
    facts = page.locator("#job-facts dt").all_text_contents()
    values = dict(zip(facts, page.locator("#job-facts dd").all_text_contents()))
    assert values["objective"] == "dpo sigmoid, beta 0.2"
    assert values["rewards/accuracies"] == "100.0 %"
    assert values["rewards/margins"] == f"{last['rewards/margins']:.4g}"
    assert values["rewards/chosen"] == f"{last['rewards/chosen']:.4g}"
    assert values["rewards/rejected"] == f"{last['rewards/rejected']:.4g}"
    evaluated = fake_rewards(steps, 2 * steps)  # the fake's eval at the end
    assert values["eval rewards/accuracies"] == "50.0 %"
    assert values["eval rewards/margins"] == f"{evaluated['rewards/margins']:.4g}"
    lines = page.locator("#events li[data-type='metrics']").all_text_contents()
    assert len(lines) == steps + 1
    assert f"reward accuracy {100 * fake_rewards(3, steps)['rewards/accuracies']:.1f} %, margin 0.3" in lines[2]
    assert lines[-1].endswith(f"step {steps}: eval loss 0.5, reward accuracy 50.0 %, margin "
                              f"{evaluated['rewards/margins']:.4g}"), lines[-1]
    assert not console_errors, console_errors
