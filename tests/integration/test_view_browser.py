"""`swectl view` in a real browser: Debian's headless Chromium driven by Selenium through Debian's chromedriver,
against `swectl view` serving a run folder the test writes (and appends to while the page is open), and the
self-contained export opened from disk with no server."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver  # the dev extra (pyproject.toml)
from selenium.common.exceptions import ElementNotInteractableException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait
from view_runs import make_up_run, metrics_row, write_episode

from swectl.testing.browser import headless_chrome

pytestmark = [pytest.mark.integration]

STEPS = 3


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    with headless_chrome() as chrome:
        yield chrome


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    run = make_up_run(tmp_path / "run", steps=STEPS, eval_steps=(1, STEPS))
    proc = subprocess.Popen([sys.executable, "-m", "swectl.cli.main", "view", "--port", "0", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the URL, once it listens
        assert line.startswith("http://"), proc.stderr.read()
        yield line.strip(), run
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait(chrome: webdriver.Chrome, condition, timeout: float = 20):
    """Until ``condition`` holds; an element the page replaced meanwhile (a re-render) is looked up again."""
    replaced = (StaleElementReferenceException, ElementNotInteractableException)
    return WebDriverWait(chrome, timeout, poll_frequency=0.2, ignored_exceptions=replaced).until(lambda d: condition(d))


def _type(chrome: webdriver.Chrome, field: str, text: str) -> None:
    """Replace a filter's text (or empty it) and press Enter (one change event: the page re-renders once); again
    if the page replaced the box meanwhile (a live update)."""
    def once(d: webdriver.Chrome) -> bool:
        box = d.find_element(By.ID, field)
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.BACKSPACE)
        box.send_keys(text + Keys.ENTER)
        return True

    _wait(chrome, once)


def _points(chrome: webdriver.Chrome, key: str, kind: str = "circle.point") -> int:
    return len(chrome.find_elements(By.CSS_SELECTOR, f'.chart[data-key="{key}"] {kind}'))


def _count(chrome: webdriver.Chrome) -> str:
    return chrome.find_element(By.ID, "episode-count").text


def _cells(chrome: webdriver.Chrome, column: str) -> list[str]:
    return [c.text for c in chrome.find_elements(By.CSS_SELECTOR, f"#episodes tr.ep td.{column}")]


def test_curves_episodes_filters_and_a_live_step(browser: webdriver.Chrome, served: tuple[str, Path]) -> None:
    url, run = served
    browser.get(url)
    _wait(browser, lambda d: _points(d, "reward_mean") == STEPS)
    assert _points(browser, "loss") == STEPS
    assert _points(browser, "resolve_rate", "rect.eval-mark") == 2  # the evaluations after steps 1 and 3
    assert _points(browser, "reward_mean", "rect.eval-mark") == 0
    # a step appended while the page is open appears without a reload
    with (run / "metrics.jsonl").open("a") as f:
        f.write(metrics_row(STEPS + 1, 0.99))
    _wait(browser, lambda d: _points(d, "reward_mean") == STEPS + 1)

    _wait(browser, lambda d: d.find_element(By.ID, "nav-episodes").click() or True)
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#episodes tr.ep"))
    assert len(browser.find_elements(By.CSS_SELECTOR, "#episodes tr.ep")) == STEPS * 4 + 1
    _type(browser, "f-instance_id", "calc-2")
    _wait(browser, lambda d: d.find_element(By.ID, "episode-count").text == f"{STEPS * 2} episodes")
    write_episode(run / "episodes" / f"step_{STEPS + 1:06d}" / "calc-2__0", "calc-2", 0, resolved=False)
    _wait(browser, lambda d: d.find_element(By.ID, "episode-count").text == f"{STEPS * 2 + 1} episodes")
    # by weight version (step N ran on the weights of step N - 1) and by reward (steps.jsonl's)
    _type(browser, "f-weight_version", "1")
    _wait(browser, lambda d: _count(d) == "2 episodes")
    assert _cells(browser, "weights") == ["1", "1"]
    _type(browser, "f-weight_version", "")
    _type(browser, "f-reward_min", "0.5")
    _wait(browser, lambda d: _count(d) == "0 episodes")
    _type(browser, "f-instance_id", "calc-1")  # its resolved training episodes (the held-out one has no reward)
    _wait(browser, lambda d: _count(d) == "5 episodes")
    assert _cells(browser, "reward") == ["1"] * 5
    _type(browser, "f-reward_min", "")
    _wait(browser, lambda d: _count(d) == f"{STEPS * 2 + 1} episodes")

    _wait(browser, lambda d: d.find_element(By.ID, "nav-tasks").click() or True)
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#tasks tr.ep"))
    rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#tasks tr.ep")]
    assert rows[0].startswith("calc-1") and rows[-1].startswith("calc-2")
    assert [r.get_attribute("data-id") for r in browser.find_elements(By.CSS_SELECTOR, "#tasks tr.never")] == ["calc-2"]
    calc1 = browser.find_element(By.CSS_SELECTOR, '#tasks tr[data-id="calc-1"]')
    assert (calc1.find_element(By.CLASS_NAME, "signal").text, calc1.find_element(By.CLASS_NAME, "no-signal").text) == (
        "1", "2")

    _wait(browser, lambda d: d.find_element(By.ID, "nav-episodes").click() or True)
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#episodes tr.ep"))
    _type(browser, "f-instance_id", "calc-1")  # its training episodes and its held-out reading
    _wait(browser, lambda d: d.find_element(By.ID, "episode-count").text == f"{STEPS * 2 + 1} episodes")
    _wait(browser, lambda d: Select(d.find_element(By.ID, "f-resolved")).select_by_value("true") or True)
    _wait(browser, lambda d: all("yes" in r.text for r in d.find_elements(By.CSS_SELECTOR, "#episodes tr.ep")))
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#episodes tr.ep")[0].click() or True)
    diff = _wait(browser, lambda d: d.find_element(By.ID, "diff"))
    assert "+return a + b" in diff.text
    assert browser.find_elements(By.CSS_SELECTOR, "#diff span.add")
    tokens = {(t.get_attribute("class"), t.text) for t in browser.find_elements(By.CSS_SELECTOR, "#diff span span")}
    assert {("hunk", "@@ -1,2 +1,2 @@"), ("kw", "def"), ("kw", "return"), ("com", "# add"), ("str", "'sum'"),
            ("num", "2")} <= tokens
    assert browser.find_element(By.CSS_SELECTOR, "#diff span.file").text == "diff --git a/calc.py b/calc.py"
    assert "resolved" in browser.find_element(By.ID, "verdict").text
    assert "format error" in browser.page_source and "PASSED" in browser.find_element(By.ID, "log").text
    assert browser.find_element(By.ID, "format-errors").text.endswith("at turn 2")
    assert "turn 2 saw 3 earlier turns omitted" in browser.find_element(By.ID, "context-cut").text
    assert "left out 3 earlier turn" in browser.find_element(By.CLASS_NAME, "cut-marker").text

    # two episodes of one group side by side: one that failed its tests, one resolved
    _wait(browser, lambda d: d.find_element(By.ID, "nav-episodes").click() or True)
    _wait(browser, lambda d: Select(d.find_element(By.ID, "f-resolved")).select_by_value("") or True)
    row = '#episodes tr.ep[data-id="episodes/step_000002/calc-1__1"]'
    _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, row).click() or True)
    _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#compare button[data-id$="calc-1__0"]').click() or True)
    _wait(browser, lambda d: d.find_element(By.ID, "diff-b") and d.find_element(By.ID, "diff"))
    assert "+return a + b" in browser.find_element(By.ID, "diff-b").text
    assert browser.find_element(By.ID, "failed-tests").text.splitlines() == [
        "FAIL_TO_PASS tests/test_calc.py::test_add", "PASS_TO_PASS tests/test_calc.py::test_sub"]
    assert "pass-to-pass failed 1/2" in browser.find_element(By.ID, "tests").text
    assert not browser.find_elements(By.ID, "failed-tests-b")


def test_the_export_opens_from_disk_without_a_server(browser: webdriver.Chrome, tmp_path: Path) -> None:
    run = make_up_run(tmp_path / "run", steps=STEPS)
    out = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", "view", "--html", str(out), str(run)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not re.search(r"<script[^>]+src=", out.read_text())
    browser.get(out.as_uri())
    _wait(browser, lambda d: _points(d, "reward_mean") == STEPS)
    assert "exported page" in browser.find_element(By.ID, "status").text
    _wait(browser, lambda d: d.find_element(By.ID, "nav-episodes").click() or True)
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#episodes tr.ep")) == STEPS * 4 + 1)
    _type(browser, "f-weight_version", "2")  # the export filters its own rows: weight versions are in them
    _wait(browser, lambda d: _count(d) == "4 episodes")
    _type(browser, "f-reward_min", "0.5")
    _wait(browser, lambda d: _count(d) == "2 episodes")
    _type(browser, "f-weight_version", "")
    _type(browser, "f-reward_min", "")
    _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#episodes tr.ep[data-id^="eval/"]').click() or True)
    assert "+return a + b" in _wait(browser, lambda d: d.find_element(By.ID, "diff")).text

