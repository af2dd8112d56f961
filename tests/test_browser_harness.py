"""tests/_browser.py against a real page in a real headless Chromium: a page that polls the server every
300 ms and shows the number it gets, which the server increases on every request; and no browser process
outlives the helper's block."""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from _browser import chromium_page, expect

PAGE = b"""<!doctype html>
<html><head><title>counter</title></head>
<body><p id="count">none yet</p>
<script>
  async function poll() {
    const reply = await fetch("/count.json", {cache: "no-store"});
    document.getElementById("count").textContent = String((await reply.json()).count);
  }
  poll();
  setInterval(poll, 300);
</script></body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    counts = itertools.count(1)  # the number /count.json returns, one larger on every request
    page_loads = 0

    def do_GET(self):
        if self.path == "/":
            type(self).page_loads += 1
            body, kind = PAGE, "text/html; charset=utf-8"
        elif self.path == "/count.json":
            body, kind = b'{"count": %d}' % next(self.counts), "application/json"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, name, state) of every process on the machine, from /proc/<pid>/stat."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        name_end = stat.rindex(")")  # the name is in parentheses and may hold spaces and parentheses
        state, parent = stat[name_end + 2 :].split()[:2]
        found[int(entry)] = (int(parent), stat[stat.index("(") + 1 : name_end], state)
    return found


def running_chromium(table: dict[int, tuple[int, str, str]]) -> set[int]:
    return {pid for pid, (_, name, state) in table.items() if name == "chromium" and state != "Z"}


def descendants(table: dict[int, tuple[int, str, str]], root: int) -> set[int]:
    below: set[int] = set()
    while more := {pid for pid, (parent, _, _) in table.items() if parent in below | {root}} - below:
        below |= more
    return below


def test_page_shows_a_number_that_grows_without_reloading(server):
    loads = _Handler.page_loads
    with chromium_page() as page:
        page.goto(server)
        expect(page).to_have_title("counter")
        count = page.locator("#count")
        expect(count).to_have_text(re.compile(r"^[0-9]+$"))
        first = int(count.inner_text())
        assert first >= 1
        page.evaluate("window.marker = 'same document'")  # a reload would lose it
        page.wait_for_function("first => Number(document.getElementById('count').textContent) > first", arg=first)
        assert page.evaluate("window.marker") == "same document"
    assert _Handler.page_loads == loads + 1


def test_no_browser_process_outlives_the_block(server):
    with chromium_page() as page:
        page.goto(server)
        table = processes()
        browser = running_chromium(table) & descendants(table, os.getpid())
        assert browser, "no chromium process below this one"
    # Its helper processes, orphaned by then, end just after it: give them a moment; then none may still run.
    deadline = time.monotonic() + 5
    while (left := browser & running_chromium(processes())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"chromium processes {sorted(left)} still run"
