"""Screenshots of `swectl view`'s main views of a run, for the docs (headless Chromium, as the browser tests).

    python scripts/view_screenshots.py RUN_DIR [--out docs/images] [--prefix view]

Writes PREFIX-runs.png (curves), PREFIX-tasks.png, PREFIX-episodes.png and PREFIX-episode.png (the first resolved
training episode, else the first episode).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from swectl.testing.browser import headless_chrome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--prefix", default="view")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "swectl.cli.main", "view", "--port", "0", str(args.run_dir)],
                            stdout=subprocess.PIPE, text=True)
    try:
        with headless_chrome() as chrome:
            wait = WebDriverWait(chrome, 30, ignored_exceptions=(StaleElementReferenceException,))
            chrome.get(proc.stdout.readline().strip())
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".chart svg"))
            chrome.save_screenshot(str(args.out / f"{args.prefix}-runs.png"))
            for view, ready in (("tasks", "#tasks tr.ep"), ("episodes", "#episodes tr.ep")):
                wait.until(lambda d, v=view: d.find_element(By.ID, f"nav-{v}").click() or True)
                wait.until(lambda d, r=ready: d.find_elements(By.CSS_SELECTOR, r))
                chrome.save_screenshot(str(args.out / f"{args.prefix}-{view}.png"))
            rows = chrome.find_elements(By.CSS_SELECTOR, '#episodes tr.ep[data-id^="episodes/"]')
            pick = next((r for r in rows if "yes" in r.text), rows[0] if rows else None)
            if pick is not None:
                pick.click()
                wait.until(lambda d: d.find_element(By.ID, "diff"))
                chrome.save_screenshot(str(args.out / f"{args.prefix}-episode.png"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"wrote {args.out}/{args.prefix}-*.png")


if __name__ == "__main__":
    main()
