"""The CDP harness of tests/_browser.py against a real page in a real headless Chromium: a page that polls
the server every 300 ms and shows the number it gets, which the server increases on every request."""

from __future__ import annotations

import itertools
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from _browser import Browser

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
SHOWN = "document.getElementById('count').textContent"


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


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


def test_page_shows_a_number_that_grows_without_reloading(server, browser):
    loads = _Handler.page_loads
    browser.open(server)
    assert browser.evaluate("document.title") == "counter"
    first = browser.wait_for(f"/^[0-9]+$/.test({SHOWN}) && Number({SHOWN})", timeout=10)
    assert isinstance(first, int) and first >= 1
    browser.evaluate("window.marker = 'same document'")  # a reload would lose it
    later = browser.wait_for(f"Number({SHOWN}) > {first} && Number({SHOWN})", timeout=10)
    assert later > first
    assert browser.evaluate("window.marker") == "same document"
    assert _Handler.page_loads == loads + 1


def test_evaluate_raises_on_javascript_exceptions_and_wait_for_times_out(server, browser):
    browser.open(server)
    assert browser.evaluate("Promise.resolve([1, {a: 2}])") == [1, {"a": 2}]
    with pytest.raises(RuntimeError, match="boom"):
        browser.evaluate("(() => { throw new Error('boom') })()")
    with pytest.raises(RuntimeError, match="rejected"):
        browser.evaluate("Promise.reject(new Error('rejected'))")
    with pytest.raises(RuntimeError, match="ReferenceError"):
        browser.evaluate("no_such_variable")
    with pytest.raises(AssertionError, match=r"1 === 2.*last value: False"):
        browser.wait_for("1 === 2", timeout=0.5, interval=0.1)
