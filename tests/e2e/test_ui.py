"""The Airflow UI as a person uses it, in a real browser: Debian's chromium driven by Playwright, against
Airflow's four processes (with Relay's API-server plugin), the session's Ray head and S3 server.

Log in on the login page; trigger relay_demo with the form's defaults and watch the run succeed; type
an invalid run name and read why it is refused; follow the train task's link to its Ray job's page;
approve a settings change on the task's Required Actions page. Screenshots go to
.relay/test-results/screenshots/ (docs/airflow-grid.png, docs/airflow-trigger-form.png and
docs/airflow-approval.png are copies of them).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from urllib.parse import unquote

import pytest
from playwright.sync_api import expect

from relay.devstack import stack
from relay.spec.run_spec import load_spec
from support.airflow_procs import airflow_processes
from support.helpers import ROOT, session_shared, write_spec

SHOTS = ROOT / ".relay" / "test-results" / "screenshots"
# As the machine notes start it: no background connections (this machine's network is closed), no sandbox (root).
UI_TIMEOUT_MS = 120_000
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def airflow(tmp_path_factory, ray_address, airflow_home):
    """Airflow on SQLite (the session's migrated DB, copied), reading one spec named `demo`: relay_demo,
    shrunk for tests (12 steps in 2 chunks) and publishing under an S3 prefix of its own."""
    base = tmp_path_factory.mktemp("ui")
    runs = base / "runs"
    write_spec(runs, name="demo")
    (base / "home").mkdir()
    with session_shared(tmp_path_factory, "airflow-db") as shared:
        shutil.copyfile(shared / "airflow.db", base / "home" / "airflow.db")
    with airflow_processes(base, runs) as af:
        af["api"].wait_for_dag("relay_demo")
        yield {**af, "runs": runs}


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: scripts/test.sh installs it (apt-get install chromium)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, airflow):
    """A browser tab logged in through Airflow's login page, as a person does."""
    context = browser.new_context(viewport={"width": 1500, "height": 900})
    # Each wait of the page (a navigation, an element to appear) allows 2 minutes, not Playwright's 30 s: on the
    # 2-core machine beside the rest of the suite, the API server took over 30 s to answer the form's POST.
    context.set_default_timeout(UI_TIMEOUT_MS)
    context.set_default_navigation_timeout(UI_TIMEOUT_MS)
    tab = context.new_page()
    tab.goto(airflow["url"])
    tab.fill("input[name=username]", "admin")
    tab.fill("input[name=password]", airflow["password"])
    tab.get_by_role("button", name="Sign in").click()
    tab.wait_for_url(f"{airflow['url']}/")
    yield tab
    context.close()


def shot(tab, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(SHOTS / name))
    return SHOTS / name


def look_away(tab) -> None:
    """Leave Airflow's pages while a test waits minutes on a run through the REST API: a run's page refreshes its
    grid every few seconds, which kept chromium and the API server busy on CPUs the run itself needs."""
    tab.goto("about:blank")


def open_trigger_form(tab, airflow):
    tab.goto(f"{airflow['url']}/dags/relay_demo")
    tab.get_by_role("button", name="Trigger").first.click()
    dialog = tab.get_by_role("dialog")
    dialog.get_by_text("Run Parameters").wait_for()
    return dialog


@pytest.fixture(scope="module")
def triggered(page, airflow):
    """relay_demo triggered from its form, every field as the form opens; the DAG run's page it lands on."""
    dialog = open_trigger_form(page, airflow)
    time.sleep(1)  # the form validates its fields as it renders
    shot(page, "airflow-trigger-form.png")
    button = dialog.get_by_role("button", name="Trigger")
    state = {"enabled": button.is_enabled(), "required": dialog.locator("[data-part=required-indicator]").count()}
    button.click()
    page.wait_for_url("**/runs/**")
    run_id = page.url.rsplit("/runs/", 1)[1].split("/")[0]
    url = page.url
    look_away(page)
    return {**state, "run_id": unquote(run_id), "url": url}


def test_triggering_relay_demo_with_the_form_defaults_runs_it_to_success(page, airflow, triggered):
    assert triggered["enabled"], "the Trigger button is enabled with the form's defaults"
    assert triggered["required"] == 0, "no field of the form is required"
    assert triggered["run_id"].startswith("demo__manual__"), "the DAG run's id names the training run"
    run = airflow["api"].wait_for_run("relay_demo", triggered["run_id"], timeout=900)
    assert run["state"] == "success", airflow["api"].task_instances("relay_demo", triggered["run_id"])

    page.goto(triggered["url"])
    page.get_by_text("training run: demo").wait_for()  # the note, on the DAG run's page
    expand = page.get_by_role("button", name="Expand all task groups")
    if expand.count():  # the UI remembers whether groups were expanded
        expand.click()
    page.get_by_text("Success").first.wait_for()
    time.sleep(2)  # the grid's bars settle
    shot(page, "airflow-grid.png")
    tis = airflow["api"].task_instances("relay_demo", triggered["run_id"])
    states = {t["task_id"]: t["state"] for t in tis}
    assert states["chunk_02.publish"] == "success" and states["finish"] == "success"

    # What a person reads in the task logs of a successful run: no ERROR, and none of the platforms' noise.
    from relay.common.quiet import NOISE

    for t in tis:
        log = airflow["api"].task_log("relay_demo", triggered["run_id"], t["task_id"], t["try_number"])
        records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        errors = [r.get("event") for r in records if r.get("level") in ("error", "critical")]
        assert records and not errors, f"{t['task_id']}: {errors}"
        assert not [n for n in (*NOISE, "set_vital", "GitWildMatchPattern") if n in log], f"{t['task_id']}: {log[-3000:]}"


def test_an_invalid_run_name_is_refused_in_plain_words(page, airflow, triggered):
    before = len(airflow["api"].dag_runs("relay_demo"))
    dialog = open_trigger_form(page, airflow)
    page.fill("#element_run", "../x")
    dialog.get_by_role("button", name="Trigger").click()  # the dialog scrolls down to the button
    message = dialog.get_by_text("is not a run name")
    message.wait_for()
    text = message.inner_text()
    assert "Run: '../x' is not a run name" in text and "e.g. 'demo-2'" in text
    assert "Failed validating" not in dialog.inner_text() and "^" not in text, "no jsonschema dump, no regex"
    # The reason where the person is looking: in the toast (not only "Bad Request"), and in view in the dialog.
    toast = page.locator('[data-scope="toast"][data-part="root"]').filter(has_text="Failed to Trigger").first
    expect(toast).to_contain_text("Run: '../x' is not a run name", timeout=10_000)
    expect(toast).to_be_in_viewport()
    expect(message).to_be_in_viewport(ratio=0.9)
    for shown in (message, toast.get_by_text("is not a run name").first):  # wrapped at words, never mid-word
        style = shown.evaluate("e => [getComputedStyle(e).wordBreak, getComputedStyle(e).overflowWrap]")
        assert style[0] == "normal" and style[1] in ("break-word", "normal"), style
    shot(page, "airflow-trigger-refused.png")
    assert len(airflow["api"].dag_runs("relay_demo")) == before, "nothing was triggered"
    page.keyboard.press("Escape")


def test_the_train_task_links_to_its_ray_job_and_the_run_report(page, airflow, triggered):
    airflow["api"].wait_for_run("relay_demo", triggered["run_id"], timeout=900)
    page.goto(f"{triggered['url']}/tasks/chunk_01.train/details")
    link = page.get_by_role("link", name="Ray job")
    href = link.get_attribute("href")
    assert href.startswith(f"{stack.ray_address()}/#/jobs/relay-demo-demo-"), href
    with page.context.expect_page() as opened:
        link.click()
    job = opened.value
    job_id = href.rsplit("/", 1)[1]
    job.get_by_text("SUCCEEDED").first.wait_for()
    assert job_id in job.inner_text("body"), "the Ray dashboard shows this job's page"
    job.close()

    page.get_by_role("link", name="Run report").click()  # Relay's page in the API server, built when opened
    page.wait_for_url("**/relay/dags/relay_demo/runs/demo/report?dag_run=**")
    assert page.get_by_role("heading", name="Run demo").is_visible()
    assert "step 12 of 12" in page.inner_text("body")
    assert page.locator("#step-12").count() == 1, "the Checkpoint link's anchor: the chunk table's row"
    page.get_by_role("link", name="Back to the DAG run in Airflow").click()
    back = unquote(triggered["url"].split("?")[0].rstrip("/"))
    page.wait_for_url(lambda url: unquote(url).startswith(back))  # the browser shows the run id percent-encoded


def test_a_confirmed_fresh_start_from_the_form_starts_the_run_again_and_keeps_the_old_one(
    page, airflow, triggered, uninterrupted
):
    """The form's fresh start of the published run `demo`: a new incarnation trains from step 0 to the same
    weights as a first run with the same seed; the old run is moved aside, locally and in S3, untouched."""
    import json

    from relay.runs.record import read_record
    from relay.s3.store import CheckpointStore, store_for_spec
    from support.helpers import assert_bitwise_equal, digests, model_state

    api = airflow["api"]
    assert api.wait_for_run("relay_demo", triggered["run_id"], timeout=900)["state"] == "success"
    spec = load_spec(airflow["runs"] / "demo.yaml", check_environment=False)
    run_dir, store = spec.run_dir("demo"), store_for_spec(spec)
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), uninterrupted)
    old = {
        "incarnation": read_record(run_dir)["incarnation"],
        "files": digests(run_dir / "global_step_12"),
        "manifest": store.manifest("demo", 12),
    }

    dialog = open_trigger_form(page, airflow)
    page.locator("label[id='switch:element_fresh_start']").click()
    page.fill("#element_confirm_fresh_start", "demo")
    with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/dagRuns")) as sent:
        dialog.get_by_role("button", name="Trigger").click()
    conf = json.loads(sent.value.post_data)["conf"]
    assert conf["fresh_start"] is True and conf["confirm_fresh_start"] == "demo", conf
    page.wait_for_url("**/runs/demo__manual__**")
    run_id = unquote(page.url.rsplit("/runs/", 1)[1].split("/")[0])
    look_away(page)
    assert api.wait_for_run("relay_demo", run_id, timeout=900)["state"] == "success", api.task_instances(
        "relay_demo", run_id
    )

    assert read_record(run_dir)["incarnation"] != old["incarnation"]
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), uninterrupted)
    assert store.manifest("demo", 12).incarnation == read_record(run_dir)["incarnation"], "published anew"
    (archived,) = (run_dir.parent / ".archive").iterdir()
    assert digests(archived / "global_step_12") == old["files"], "the old run's folder, untouched"
    aside = CheckpointStore(store.client, f"{spec.s3.uri}/.archive")
    kept = aside.manifest(archived.name, 12)
    assert kept.files == old["manifest"].files and kept.incarnation == old["incarnation"]
    aside.verify(archived.name, kept)


def test_the_report_link_opened_logged_out_goes_through_the_login_page_and_back(browser, airflow, triggered):
    """A report link opened in a browser without an Airflow session (a colleague's, an alert's) lands on Airflow's
    login page, and after the login on the report, as Airflow's own pages do."""
    airflow["api"].wait_for_run("relay_demo", triggered["run_id"], timeout=900)
    context = browser.new_context(viewport={"width": 1500, "height": 900})
    context.set_default_timeout(UI_TIMEOUT_MS)
    context.set_default_navigation_timeout(UI_TIMEOUT_MS)
    try:
        tab = context.new_page()
        report = f"{airflow['url']}/relay/dags/relay_demo/runs/demo/report"
        tab.goto(report)
        tab.wait_for_url("**/auth/login**")
        tab.fill("input[name=username]", "admin")
        tab.fill("input[name=password]", airflow["password"])
        tab.get_by_role("button", name="Sign in").click()
        tab.wait_for_url(report)
        assert tab.get_by_role("heading", name="Run demo").is_visible()
    finally:
        context.close()


def test_relay_pages_need_airflow_login(airflow):
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{airflow['url']}/relay/dags/relay_demo/runs/demo/report", timeout=30)
        raise AssertionError("the run report was served without a login")
    except urllib.error.HTTPError as e:
        assert e.code in (401, 403)


def test_a_settings_change_waits_and_is_approved_on_the_required_actions_page(page, airflow, triggered):
    """Run `demo`'s recorded settings differ from its spec's (as after an edit of its seed): triggered from the form
    with its defaults, preflight.settings asks (the diff) and waits; a person approves it on the task's Required
    Actions page, and the change is recorded as theirs."""
    from relay.runs.record import read_record, update_record
    from support.airflow_procs import wait_until_parked
    from support.polling import wait_for

    api = airflow["api"]
    assert api.wait_for_run("relay_demo", triggered["run_id"], timeout=900)["state"] == "success"
    run_dir = load_spec(airflow["runs"] / "demo.yaml", check_environment=False).run_dir("demo")
    settings = read_record(run_dir)["settings"]
    update_record(run_dir, settings={**settings, "values": {**settings["values"], "seed": 999}})

    dialog = open_trigger_form(page, airflow)
    dialog.get_by_role("button", name="Trigger").click()
    page.wait_for_url("**/runs/demo__manual__**")
    run_id = unquote(page.url.rsplit("/runs/", 1)[1].split("/")[0])
    runs_url = page.url.split("/runs/")[0]
    look_away(page)
    wait_for(
        lambda: any(
            t["task_id"] == "preflight.settings" and t["state"] == "awaiting_input"
            for t in api.task_instances("relay_demo", run_id)
        ),
        300,
        "preflight.settings to ask",
    )
    wait_until_parked("relay_demo", run_id, "preflight.settings")  # Airflow 3.3.2 fails a task answered before
    page.goto(f"{runs_url}/runs/{run_id}/tasks/preflight.settings/required_actions?map_index=-1")
    page.get_by_text("Accept a change of run demo's resume-critical settings?").first.wait_for()
    time.sleep(2)
    shot(page, "airflow-approval.png")
    body = page.inner_text("body")
    assert "Awaiting Input" in body and "seed: 999 -> " in body, body[-2000:]
    page.get_by_role("button", name="Approve").click()
    wait_for(
        lambda: any(
            t["task_id"] == "preflight.settings" and t["state"] != "awaiting_input"
            for t in api.task_instances("relay_demo", run_id)
        ),
        300,
        "the approval to reach Airflow",
    )
    look_away(page)
    assert api.wait_for_run("relay_demo", run_id, timeout=900)["state"] == "success", api.task_instances(
        "relay_demo", run_id
    )
    drift = read_record(run_dir)["drift"][-1]
    assert drift["by"].startswith("admin in the Airflow UI at ") and drift["allowed"] == ["seed"]
