"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe):
no port, no websocket client, no browser download, only the `chromium` binary (Debian's
package: `apt-get install -y chromium`)."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import time
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for path in map(shutil.which, CHROMIUM_NAMES) if path), None)


class HeadlessChromium:
    """One page of a headless browser; `evaluate` runs JavaScript in it."""

    def __init__(self, binary: str, profile_dir: str, width: int = 1400, height: int = 1000) -> None:
        # The browser reads commands on its fd 3 and writes answers on its fd 4.
        command_read, self._command_write = os.pipe()
        self._answer_read, answer_write = os.pipe()

        def wire_pipes() -> None:
            # Moved out of the way first: a pipe end may itself be fd 3 or 4, and os.dup2
            # onto itself would leave it close-on-exec.
            command = fcntl.fcntl(command_read, fcntl.F_DUPFD, 10)
            answer = fcntl.fcntl(answer_write, fcntl.F_DUPFD, 10)
            os.dup2(command, 3)
            os.dup2(answer, 4)

        self._process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--remote-debugging-pipe", f"--user-data-dir={profile_dir}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=wire_pipes, close_fds=False,
        )
        os.close(command_read)
        os.close(answer_write)
        self._buffer = b""
        self._next_id = 0
        self._session: str | None = None
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def _call(self, method: str, params: dict | None = None, timeout: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._command_write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") != self._next_id:
                continue  # an event, or the answer to an earlier call
            if "error" in answer:
                raise RuntimeError(f"{method}: {answer['error']}")
            return answer["result"]

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer")
            chunk = os.read(self._answer_read, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium exited")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str) -> None:
        """Navigate, and wait until the page and its scripts have loaded."""
        self._call("Page.navigate", {"url": url})
        self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'")

    def evaluate(self, expression: str) -> Any:
        """The expression's value (JSON-serializable)."""
        result = self._call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """The expression's value once it is truthy."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"never true: {expression}")
            time.sleep(0.1)

    def screenshot(self, path: str) -> None:
        data = self._call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        with open(path, "wb") as file:
            file.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self._session = None
            self._call("Browser.close", timeout=5)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._command_write)
        os.close(self._answer_read)
