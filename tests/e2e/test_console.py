"""The web console in a real headless browser (Chromium from the system packages, driven by
selenium) against the shared `tinkerd up`: a user trains a run through the SDK, logs in to the
console with their key, finds the run, sees its loss curve drawn with a point per step and its
constant learning rate as a labelled value, does not see another user's run, publishes and
unpublishes a checkpoint, sees their usage, samples their snapshot in the playground, and opens their
session's page: the four panels of hosted Tinker (in-flight samples, training utilization, tokens per
second, step time) and a trace export whose link is a Perfetto trace. Screenshots are saved in the test's tmp_path."""

from __future__ import annotations

import shutil
import urllib.request

import pytest
import tinker
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait
from tinker import types

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pf

from conftest import sft_data
from launcher import keys

pytestmark = pytest.mark.e2e

STEPS = 3
WAIT_S = 60


def _new_keys(stack, *users: str) -> list[str]:
    """What `tinkerd keys create --user U` does, in this process (a CLI start costs seconds)."""
    db = keys.open_database(stack.state_dir, None)
    return [keys.new_key(db, user) for user in users]


@pytest.fixture
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.fail("chromium and chromedriver are not installed (scripts/setup.sh installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1100"):
        options.add_argument(flag)
    b = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    try:
        yield b
    finally:
        b.quit()


def test_a_user_sees_their_run_and_its_loss_curve_in_the_console(stack, tiny_model_dir, browser, tmp_path):
    key, other_key = _new_keys(stack, "console-carol", "console-dave")
    service = tinker.ServiceClient(base_url=stack.url, api_key=key)
    tc = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0)
    data = sft_data(tc.get_tokenizer(), ["the console draws the loss", "one point per step"])
    losses = []
    for _ in range(STEPS):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    snapshot = tc.save_weights_for_sampler("console").result().path
    prompt = types.ModelInput.from_ints(tc.get_tokenizer().encode("the console"))
    sampled = service.create_sampling_client(model_path=snapshot).sample(   # in the session's panels
        prompt, 2, types.SamplingParams(max_tokens=4)).result()
    assert sampled.sequences
    others_run = tinker.ServiceClient(base_url=stack.url, api_key=other_key).create_lora_training_client(
        base_model=tiny_model_dir, rank=4).model_id

    wait = WebDriverWait(browser, WAIT_S)
    browser.get(f"{stack.url}/console")
    browser.find_element(By.ID, "api-key").send_keys(key)
    browser.find_element(By.ID, "login-button").click()

    # The runs list: carol's run, and not dave's.
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f'#runs-table tr[data-run-id="{tc.model_id}"]')))
    listed = [r.get_attribute("data-run-id") for r in browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")]
    assert listed == [tc.model_id]
    assert others_run not in browser.page_source

    # Its page: the loss curve has one point per step, at the losses the SDK got back.
    browser.find_element(By.LINK_TEXT, tc.model_id).click()
    curve = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, 'svg.chart[data-metric="loss:sum"]')))
    points = curve.find_elements(By.CSS_SELECTOR, "circle.point")
    assert [int(p.get_attribute("data-step")) for p in points] == list(range(1, STEPS + 1))
    assert [float(p.get_attribute("data-value")) for p in points] == pytest.approx(losses, rel=1e-6)
    assert len(curve.find_element(By.CSS_SELECTOR, "polyline.line").get_attribute("points").split()) == STEPS
    assert len(browser.find_elements(By.CSS_SELECTOR, 'svg.chart[data-metric="loss:mean"] circle.point')) == STEPS
    # The learning rate and the tokens per step never changed: each is drawn as its value, not as a
    # flat line on a "0.01 ... 0.01" axis.
    for metric, value in (("learning_rate", 1e-2), ("tokens:sum", None)):
        const = browser.find_element(By.CSS_SELECTOR, f'svg.chart[data-metric="{metric}"]')
        assert const.get_attribute("data-constant") == "true", metric
        assert value is None or float(const.get_attribute("data-value")) == pytest.approx(value)
        assert const.find_element(By.CSS_SELECTOR, "text.value").text == (
            "0.01" if value else str(int(float(const.get_attribute("data-value")))))
        assert f"constant, {STEPS} point(s): step 1 to step {STEPS}" in const.text
        assert not const.find_elements(By.CSS_SELECTOR, "polyline, circle.point")
    browser.save_screenshot(str(tmp_path / "console-run.png"))
    assert (tmp_path / "console-run.png").stat().st_size > 10_000

    # Dave's run by its URL: the API's 404, nothing of it shown.
    browser.get(f"{stack.url}/console#/runs/{others_run}")
    error = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#view .error")))
    assert "404" in error.text and "unknown training run" in error.text

    # Checkpoints: publish, then unpublish, through the buttons; the API agrees each time.
    rest = service.create_rest_client()
    browser.get(f"{stack.url}/console#/checkpoints")
    row = f'table.checkpoints tr[data-path="{snapshot}"]'
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, row + " button.publish"))).click()
    wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, row + " td.published"), "yes"))
    assert [c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [True]
    browser.find_element(By.CSS_SELECTOR, row + " button.unpublish").click()
    wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, row + " td.published"), "no"))
    assert [c.public for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [False]

    # Usage, the last 24 hours: carol's own, her training tokens exactly.
    browser.get(f"{stack.url}/console#/usage")
    trained = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, '#usage-table tr[data-kind="training"]')))
    assert trained.find_element(By.CSS_SELECTOR, "td.quantity").text == str(
        STEPS * sum(d.model_input.length for d in data))
    assert {r.get_attribute("data-user") for r in browser.find_elements(By.CSS_SELECTOR, "#usage-table tbody tr")} \
        == {"console-carol"}

    # The playground samples the snapshot through create_sampling_session + asample.
    browser.get(f"{stack.url}/console#/snapshots")
    wait.until(ec.presence_of_element_located((By.LINK_TEXT, "Sample"))).click()
    wait.until(ec.element_to_be_clickable((By.ID, "pg-sample"))).click()
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#pg-output .sample, #pg-output .error")))
    samples = browser.find_elements(By.CSS_SELECTOR, "#pg-output .sample")
    assert samples and "token(s), stopped by" in samples[0].text, browser.find_element(By.ID, "pg-output").text
    browser.save_screenshot(str(tmp_path / "console-playground.png"))

    # The session's page: the four panels, each with what this session did.
    session_id = tc.model_id.rpartition(":train:")[0]
    browser.get(f"{stack.url}/console#/sessions")
    wait.until(ec.presence_of_element_located((By.LINK_TEXT, session_id))).click()
    panels = wait.until(ec.presence_of_element_located((By.ID, "session-panels")))
    names = [p.get_attribute("data-panel") for p in panels.find_elements(By.CSS_SELECTOR, ".panel")]
    assert names == ["in-flight-samples", "training-utilization", "tokens-per-second", "step-time"]

    def panel(name):
        return browser.find_element(By.CSS_SELECTOR, f'.panel[data-panel="{name}"]')
    assert panel("in-flight-samples").find_element(By.CSS_SELECTOR, ".summary").text == "0 now"
    assert panel("in-flight-samples").find_elements(By.CSS_SELECTOR, 'svg.chart[data-metric="samples in flight"]')
    assert "% of the time" in panel("training-utilization").text
    assert [c.get_attribute("data-metric") for c in panel("tokens-per-second").find_elements(By.CSS_SELECTOR, "svg.chart")] \
        == ["training tokens/s", "generation tokens/s", "prefill tokens/s"]
    steps = panel("step-time").find_element(By.CSS_SELECTOR, f'svg.chart[data-metric="step time, {tc.model_id}"]')
    drawn = steps.find_elements(By.CSS_SELECTOR, "circle.point")
    assert [int(p.get_attribute("data-step")) for p in drawn] == list(range(1, STEPS + 1)) or (
        steps.get_attribute("data-constant") == "true" and f"{STEPS} point(s)" in steps.text)
    assert all(float(p.get_attribute("data-value")) > 0 for p in drawn)
    latency = browser.find_element(By.ID, "latency-table")
    assert {r.get_attribute("data-kind") for r in latency.find_elements(By.CSS_SELECTOR, "tbody tr")} >= {
        "create_model", "forward_backward", "optim_step", "save_weights_for_sampler"}
    browser.save_screenshot(str(tmp_path / "console-session.png"))

    # Its trace: the button's link, fetched without a key, is a Perfetto trace of the session's requests.
    browser.find_element(By.ID, "export-trace").click()
    link = wait.until(ec.presence_of_element_located((By.ID, "trace-link"))).get_attribute("href")
    with urllib.request.urlopen(link, timeout=30) as got:
        trace = pf.Trace.FromString(got.read())
    kinds = sorted(p.track_event.name for p in trace.packet if p.HasField("track_event") and
                   p.track_event.type == pf.TrackEvent.TYPE_SLICE_BEGIN and list(p.track_event.categories) == ["request"])
    assert kinds.count("forward_backward") == STEPS and kinds.count("optim_step") == STEPS
