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
from selenium.common.exceptions import StaleElementReferenceException
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
    run = make_up_run(tmp_path / "run", steps=STEPS)
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
    return WebDriverWait(chrome, timeout, poll_frequency=0.2,
                         ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: condition(d))


def _type(chrome: webdriver.Chrome, field: str, text: str) -> None:
    """Replace a filter's text and press Enter (one change event: the page re-renders once); again if the page
    replaced the box meanwhile (a live update)."""
    def once(d: webdriver.Chrome) -> bool:
        box = d.find_element(By.ID, field)
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(text + Keys.ENTER)
        return True

    _wait(chrome, once)


def _points(chrome: webdriver.Chrome, key: str) -> int:
    return len(chrome.find_elements(By.CSS_SELECTOR, f'.chart[data-key="{key}"] circle.point'))


def test_curves_episodes_filters_and_a_live_step(browser: webdriver.Chrome, served: tuple[str, Path]) -> None:
    url, run = served
    browser.get(url)
    _wait(browser, lambda d: _points(d, "reward_mean") == STEPS)
    assert _points(browser, "loss") == STEPS
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

    _wait(browser, lambda d: d.find_element(By.ID, "nav-tasks").click() or True)
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#tasks tr.ep"))
    rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#tasks tr.ep")]
    assert rows[0].startswith("calc-1") and rows[-1].startswith("calc-2")

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
    assert "resolved" in browser.find_element(By.ID, "verdict").text
    assert "format error" in browser.page_source and "PASSED" in browser.find_element(By.ID, "log").text

    # two episodes of one group side by side
    _wait(browser, lambda d: d.find_element(By.ID, "nav-episodes").click() or True)
    row = '#episodes tr.ep[data-id="episodes/step_000001/calc-1__0"]'
    _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, row).click() or True)
    _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#compare button[data-id$="calc-1__1"]').click() or True)
    _wait(browser, lambda d: d.find_element(By.ID, "diff-b") and d.find_element(By.ID, "diff"))
    assert "+return a + b" in browser.find_element(By.ID, "diff-b").text


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
    _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, '#episodes tr.ep[data-id^="eval/"]').click() or True)
    assert "+return a + b" in _wait(browser, lambda d: d.find_element(By.ID, "diff")).text

