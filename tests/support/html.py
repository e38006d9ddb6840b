"""Helpers of tests/test_html.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any


def chromium_binary() -> str | None:
    found = shutil.which("chromium")
    return found or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
    "--force-color-profile=srgb",
    # belt and braces: a request that did slip out could not reach anything
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=127.0.0.1:9",
    "--proxy-bypass-list=<-loopback>",
    "--window-size=1280,2000",
)


class DevTools:
    """A headless Chromium driven over ``--remote-debugging-pipe`` (fd 3 in, fd 4 out)."""

    def __init__(self, binary: str, workdir: Path, deadline: float):
        self.deadline = deadline
        self.events: list[dict[str, Any]] = []
        self._id = 0
        to_child, self._to_browser = os.pipe()
        self._from_browser, from_child = os.pipe()

        def wire() -> None:  # runs in the child: the pipes become fds 3 and 4
            a = fcntl.fcntl(to_child, fcntl.F_DUPFD, 10)  # out of the way of 3 and 4 first
            b = fcntl.fcntl(from_child, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.stderr = (workdir / "chromium.log").open("wb")
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={workdir / 'profile'}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
            close_fds=False,
            preexec_fn=wire,
        )
        os.close(to_child)
        os.close(from_child)
        self._buffer = b""

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict[str, Any]:
        for seen in self.events:
            if seen.get("method") == method:
                self.events.remove(seen)
                return seen
        while True:
            event = self._read()
            if event.get("method") == method:
                return event
            self.events.append(event)

    def open(self, url: str) -> str:
        """A fresh tab with network, console and log reporting on, navigated to ``url``."""
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.send(f"{domain}.enable", session)
        self.send(
            "Emulation.setDeviceMetricsOverride", session, width=1280, height=2000, deviceScaleFactor=1, mobile=False
        )
        self.events.clear()
        self.send("Page.navigate", session, url=url)
        self.wait_for("Page.loadEventFired")
        self.send("Runtime.evaluate", session, expression="1", awaitPromise=True)  # flush
        return session

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.stderr.close()
        os.close(self._to_browser)
        os.close(self._from_browser)


def requests_and_errors(events: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    urls = [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"]
    errors = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
            errors.append(f"console.{p['type']}: {[a.get('value') for a in p.get('args', [])]}")
        elif m == "Runtime.exceptionThrown":
            errors.append(f"exception: {p['exceptionDetails'].get('text')}")
        elif m == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
            errors.append(f"log {p['entry']['level']}: {p['entry']['text']}")
    return urls, errors
