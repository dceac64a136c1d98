"""Screenshot of the Gradio demo running the shipped drafter on the real target (docs/demo.png).

    python scripts/demo_screenshot.py --mode async --out docs/demo.png

Needs `pip install -e .[dev]` (Playwright) and Debian's chromium, as `.ci/run` installs them. Starts the
demo on a free local port, drives it with Playwright, runs one
prompt with the side-by-side plain `generate` enabled and saves a full-page screenshot.
"""

from __future__ import annotations

import argparse
import socket

import torch
from playwright.sync_api import sync_playwright

from dspark_hf.defaults import default_drafter
from dspark_hf.demo.app import launch

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Write a short poem about the sea.")
    parser.add_argument("--mode", default="async")
    parser.add_argument("--gamma", default="7")
    parser.add_argument("--max-new-tokens", default="64")
    parser.add_argument("--drafter", default=str(default_drafter()))
    parser.add_argument("--browser", default="/usr/bin/chromium")
    parser.add_argument("--out", default="docs/demo.png")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (as the dspark commands)")
    parser.add_argument("--width", type=int, default=1280, help="browser window width in pixels (a laptop's default)")
    args = parser.parse_args(argv)
    port = free_port()
    app = launch(None, None, args.drafter, port=port, prevent_thread_lock=True, max_new_tokens=int(args.max_new_tokens))
    torch.set_num_threads(args.threads)  # after loading: load_target sets the default
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.browser, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": args.width, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/")
            page.fill("#dspark-prompt textarea", args.prompt)
            page.locator(f"#dspark-mode input[value={args.mode}]").check()
            for label, value in (("gamma", args.gamma), ("max-new", args.max_new_tokens)):
                box = page.locator(f"#dspark-{label} input[type=number]").first
                box.fill(value)
                box.press("Enter")
            page.locator("#dspark-side input[type=checkbox]").check()
            page.click("#dspark-run")
            page.wait_for_selector('#dspark-stats [data-stat="speedup"]', timeout=600_000)
            page.locator("#dspark-rounds details.dspark-rounds summary").click()  # the per-round table, own row
            page.locator("#dspark-output .ghost .dot").first.hover()  # one round's rejected / unverified drafts
            page.wait_for_timeout(1500)
            print(page.inner_text("#dspark-stats"))
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        app.close()


if __name__ == "__main__":
    main()
