"""Headless Chromium driven as a user drives it: open a page, click, read what is rendered, take a screenshot.

Chromium's DevTools protocol over ``--remote-debugging-pipe``: JSON messages ending in a NUL byte,
written to the browser's file descriptor 3 and read from its descriptor 4 (no WebSocket, no extra
package).  Only what the browser tests need: :meth:`Browser.open`, :meth:`Browser.js`,
:meth:`Browser.wait_for`, :meth:`Browser.click_text`, :meth:`Browser.key`, :meth:`Browser.screenshot`.
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--force-device-scale-factor=1"]


class Browser:
    def __init__(self, chromium: str, profile: Path, size: tuple[int, int] = (1600, 1000)):
        to_r, self._to_w = os.pipe()          # we write, the browser reads on its fd 3
        self._from_r, from_w = os.pipe()      # the browser writes on its fd 4, we read

        def onto_3_and_4() -> None:           # in the child: the pipes' ends as 3 and 4, whatever numbers they had
            a, b = os.dup(to_r), os.dup(from_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen([chromium, *FLAGS, f"--window-size={size[0]},{size[1]}",
                                      f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
                                     pass_fds=(3, 4), preexec_fn=onto_3_and_4, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self._buf, self._id, self.session = b"", 0, None

    def send(self, method: str, params: dict | None = None, browser: bool = False, timeout: float = 120) -> dict:
        """One command; its result (the events in between are dropped)."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if self.session and not browser:
            msg["sessionId"] = self.session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                ready, _, _ = select.select([self._from_r], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise TimeoutError(f"Chromium did not answer {method} in {timeout} s")
                chunk = os.read(self._from_r, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed its pipe (exit code {self.proc.poll()})")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            doc = json.loads(raw)
            if doc.get("id") == self._id:
                if "error" in doc:
                    raise RuntimeError(f"{method}: {doc['error']}")
                return doc.get("result", {})

    def open(self, url: str) -> None:
        """A new tab on ``url`` (the one the other methods act on)."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, browser=True)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, browser=True)["sessionId"]
        self.send("Page.enable")
        self.send("Page.navigate", {"url": url})

    def js(self, expression: str, timeout: float = 120) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                      timeout=timeout)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:200]}: {r['exceptionDetails'].get('exception', r['exceptionDetails'])}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 300, what: str = "") -> Any:
        """Poll ``expression`` until it is truthy (an exception while the page loads counts as not yet); its
        value.  A TimeoutError names ``what`` and the page's text."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.js(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what or expression} not on the page after {timeout} s: {self.text()[:2000]}")
            time.sleep(0.3)

    def text(self) -> str:
        """What the page shows, as text."""
        return self.js("document.body ? document.body.innerText : ''") or ""

    def click_text(self, text: str, selector: str = "button") -> None:
        """Click the first ``selector`` element whose text is ``text`` (waiting for it to appear)."""
        found = json.dumps(text)
        self.wait_for(f"Array.from(document.querySelectorAll({json.dumps(selector)}))"
                      f".some(e => e.innerText.trim() === {found})", what=f"a {selector} '{text}'")
        self.js(f"Array.from(document.querySelectorAll({json.dumps(selector)}))"
                f".find(e => e.innerText.trim() === {found}).click()")

    def key(self, key: str, code: str, key_code: int) -> None:
        """Press and release one key (``"Escape", "Escape", 27``)."""
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": key, "code": code,
                                                 "windowsVirtualKeyCode": key_code})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"]))

    def close(self) -> None:
        try:
            self.send("Browser.close", browser=True, timeout=20)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for fd in (self._to_w, self._from_r):
            try:
                os.close(fd)
            except OSError:
                pass
