"""Headless Chromium driven by selenium, for `swectl view`'s browser tests and its screenshots: Debian's
`chromium` and `chromium-driver` (scripts/setup.sh installs them), never a driver downloaded at run time."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from selenium import webdriver

FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000")


@contextmanager
def headless_chrome() -> Iterator[webdriver.Chrome]:
    """A Chrome session on the system's Chromium; AssertionError when it or its driver is not installed."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "chromium and chromium-driver come from scripts/setup.sh (apt)"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    chrome = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    try:
        yield chrome
    finally:
        chrome.quit()
