"""Check the built documentation site in a real headless browser: `python3 .ci/check_site.py build/site SHOTS`.

Serves the site over http on localhost (search needs http, not file://), drives Debian's `chromium` through the
DevTools protocol (a websocket, spoken here with the standard library alone: no selenium, no downloaded
browser), and checks that
- the front page, a tutorial chapter and an API page load with no console error, uncaught exception or failed
  request (a missing script, stylesheet or image), each showing its own heading;
- search, opened as `?q=train_step` the way mkdocs-material shares a search, lists `purejax.optim.train_step`
  (its API entry).
It saves a screenshot of each page into SHOTS, to be looked at. Exits 0 when all hold, 1 with the reasons if not.
`.ci/run docs` runs it after the strict build, and skips it with the reason when chromium is not installed.
"""

import base64
import functools
import http.server
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

PAGES = {  # screenshot name: (path under the site, text its <h1> must hold)
    "front": ("", "purejax"),
    "tutorial": ("tutorial/01-pure-functions/", "Chapter 1"),
    "api-optim": ("api/optim/", "purejax.optim"),
}
SEARCH = ("train_step", "/api/optim/#purejax.optim.train_step.train_step")  # the query, a result it must list
TIMEOUT_S = 30.0


def masked_frame(text: str) -> bytes:
    """One final text frame (opcode 1), masked with a random key as a client must: the length in 7 bits, or
    126 then 16 bits, or 127 then 64 bits, each with the mask bit set."""
    data, mask = text.encode(), os.urandom(4)
    if len(data) < 126:
        length = bytes([0x80 | len(data)])
    elif len(data) < 1 << 16:
        length = bytes([0x80 | 126]) + struct.pack(">H", len(data))
    else:
        length = bytes([0x80 | 127]) + struct.pack(">Q", len(data))
    return bytes([0x81]) + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


class DevTools:
    """The smallest DevTools-protocol client: one websocket to one page, text frames of JSON, masked as RFC 6455
    requires of a client. `call` sends a command and waits for its answer; events that arrive meanwhile are kept
    in `events`."""

    def __init__(self, ws_url: str):
        host_port, path = ws_url.removeprefix("ws://").split("/", 1)
        host, port = host_port.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET /{path} HTTP/1.1\r\nHost: {host_port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        response = b""
        while b"\r\n\r\n" not in response:
            response += self.sock.recv(4096)
        if b" 101 " not in response.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"DevTools websocket handshake refused: {response[:200]!r}")
        self.buffer = response.split(b"\r\n\r\n", 1)[1]
        self.next_id = 0
        self.events: list[dict] = []

    def _read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools websocket")
            self.buffer += chunk
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def _receive(self) -> dict:
        payload = b""
        while True:  # a message may come in several frames; the server never masks its frames
            first, second = self._read(2)
            length = second & 0x7F
            if length == 126:
                length = struct.unpack(">H", self._read(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", self._read(8))[0]
            payload += self._read(length)
            if first & 0x80:  # FIN
                return json.loads(payload)

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.sock.sendall(masked_frame(json.dumps({"id": self.next_id, "method": method, "params": params})))
        while True:
            message = self._receive()
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"DevTools {method} failed: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, what: str):
        """Poll `expression` in the page until it is truthy; fail after TIMEOUT_S, naming `what`."""
        deadline = time.monotonic() + TIMEOUT_S
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {TIMEOUT_S:.0f} s for {what}")
            time.sleep(0.2)
        return value


def problems_in(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions and failed loads among the DevTools events."""
    found = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            found.append(f"console error: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            found.append(f"uncaught exception: {details.get('exception', {}).get('description', details['text'])}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            found.append(f"browser error: {params['entry']['text']} ({params['entry'].get('url', '')})")
    return found


def check_page(tools: DevTools, url: str, heading: str, shot: Path) -> list[str]:
    tools.events.clear()
    tools.call("Page.navigate", url=url)
    tools.wait_for("document.readyState === 'complete'", f"{url} to load")
    h1 = tools.evaluate("document.querySelector('article h1') && document.querySelector('article h1').textContent")
    problems = problems_in(tools.events)
    if not h1 or heading not in h1:
        problems.append(f"its <h1> is {h1!r}, expected one holding {heading!r}")
    shot.write_bytes(base64.b64decode(tools.call("Page.captureScreenshot", format="png")["data"]))
    return [f"{url}: {p}" for p in problems]


def check_search(tools: DevTools, base: str, shot: Path) -> list[str]:
    query, expected = SEARCH
    tools.events.clear()
    tools.call("Page.navigate", url=f"{base}?q={query}")
    links_js = "[...document.querySelectorAll('.md-search-result__link')].map(a => a.href)"
    try:  # the index loads in a web worker: wait for the first results, then for the worker to settle
        tools.wait_for(f"{links_js}.length > 0", f"search results for {query!r}")
    except TimeoutError as e:
        return [f"search: {e}"]
    time.sleep(0.5)
    links = tools.evaluate(links_js)
    shot.write_bytes(base64.b64decode(tools.call("Page.captureScreenshot", format="png")["data"]))
    problems = [f"search: {p}" for p in problems_in(tools.events)]
    found = [f"{u.path}#{u.fragment}" for u in map(urllib.parse.urlsplit, links)]  # without mkdocs' ?h=query
    if expected not in found:
        problems.append(f"search for {query!r} lists {found[:8]}, not {expected!r}")
    return problems


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    quiet = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def start_chromium(browser: str, profile: str) -> tuple[subprocess.Popen, DevTools]:
    """Headless chromium on a free DevTools port, and a client attached to its one page."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # --no-sandbox: CI containers run as root, where chromium's sandbox refuses to start.
    flags = [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--remote-debugging-port={port}",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ]
    process = subprocess.Popen([browser, *flags, "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as response:
                pages = [t for t in json.load(response) if t["type"] == "page"]
            if pages:
                break
        except OSError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError(f"chromium did not open its DevTools port {port} within {TIMEOUT_S:.0f} s")
        time.sleep(0.2)
    tools = DevTools(pages[0]["webSocketDebuggerUrl"])
    for domain in ("Page", "Runtime", "Log"):
        tools.call(f"{domain}.enable")
    return process, tools


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    site, shots = Path(argv[0]), Path(argv[1])
    if not (site / "index.html").exists():
        print(f"check_site: no {site}/index.html: build the site first (python3 dev.py docs)", file=sys.stderr)
        return 1
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("check_site: no chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 1
    shots.mkdir(parents=True, exist_ok=True)
    server, base = serve(site)
    with tempfile.TemporaryDirectory(prefix="purejax-chromium-") as profile:
        process, tools = start_chromium(browser, profile)
        try:
            problems = []
            for name, (path, heading) in PAGES.items():
                problems += check_page(tools, base + path, heading, shots / f"{name}.png")
            problems += check_search(tools, base, shots / "search.png")
        finally:
            process.kill()
            process.wait()
            server.shutdown()
    for problem in problems:
        print(f"check_site: {problem}", file=sys.stderr)
    checked = [*PAGES, f"search {SEARCH[0]!r}"]
    print(f"check_site: {'FAILED' if problems else 'passed'}: {', '.join(checked)}; screenshots in {shots}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
