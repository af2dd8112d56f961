"""Debian's headless Chromium driven by Playwright, for tests (not a test module itself).

Playwright launches Debian's chromium (installed with apt-get when missing) rather than a browser of its
own: `playwright install` downloads one, and tests reach no further than the package registries. Usage:
`with chromium_page() as page: page.goto(url); expect(page.locator("#count")).to_have_text("1")`.

Playwright's sync API runs an asyncio loop of its own in the calling thread, which therefore must not be
running one (call it outside `async def`); loops running in other threads, like the in-process swarm's
(the `swarm` fixture), go on undisturbed."""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Iterator

from _util import apt_install
from playwright.sync_api import Page, expect, sync_playwright

HINT = "install it by hand: sudo apt-get install -y --no-install-recommends chromium"
TIMEOUT_MS = 30_000  # for every wait and expect(): the health page shows a change in 2 s or more, on busy cores

GPU_OFF = ["--disable-gpu"]  # test machines have no GPU: render in software, without trying hardware GL first

expect.set_options(timeout=TIMEOUT_MS)  # instead of Playwright's 5 s; a process-wide setting, so set on import


@functools.cache
def ensure_chromium() -> str:
    """The path of Debian's chromium, installed with apt-get (as root) if it is not on PATH yet."""
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    apt_install("chromium", HINT)
    if path := shutil.which("chromium") or shutil.which("chromium", path="/usr/bin"):
        return path
    raise RuntimeError(f"apt-get installed chromium but it is not on PATH; {HINT}")


@contextlib.contextmanager
def chromium_page() -> Iterator[Page]:
    """A blank page in a new headless Chromium; the browser and Playwright's driver are gone when the block
    ends. Playwright already passes --headless, --no-sandbox, --disable-dev-shm-usage and the switches
    that keep Chromium off the network (--disable-background-networking, --disable-component-update,
    --disable-sync, --no-first-run)."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=ensure_chromium(), args=GPU_OFF)
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            yield page
        finally:
            browser.close()
