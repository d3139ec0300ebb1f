"""`diffgraph generate`'s progress on a terminal: loading, each step, decode, on one stderr line;
and the HTTP POSTs of `generate --url`, streamed when there is a bar to move. Nothing is printed when stderr is not
a terminal, or with --quiet."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable


class Progress:
    """generate's progress on a terminal: one stderr line redrawn in place ("loading digits 1.2 s", then
    "step 3/20 |███   | 0.4 s", then "step 20/20 |██████| decoding 0.1 s"), cleared before the usual output. Only
    when stderr is a terminal and not --quiet (`progress_for`); otherwise it is inert and prints nothing.

    Progress callbacks (the engine's loop thread, or the loop reading the server's events) only store the state
    under a lock and wake a drawing thread: a slow terminal never holds a step, and a failing write turns the bar
    off, never the generation. While the bar is up, stderr (a logged warning) clears its line before writing."""

    def __init__(self, out: Any = None):
        self.active = out is not None
        self._out = out
        self._lock = threading.Lock()        # the state: text, since (taken by callbacks, never held for I/O)
        self._draw_lock = threading.Lock()   # the terminal: what is on the line
        self._text, self._since, self._kind = "", time.monotonic(), ""
        self._shown = self._midline = self._broken = self._closed = False
        self._drawn = ""  # the line on the terminal, not written again while it is the same
        self._wake = threading.Event()
        self._restore: list[Callable[[], None]] = []
        self._fill = "█"
        try:
            self._fill.encode(getattr(out, "encoding", None) or "ascii")
        except (UnicodeError, LookupError):  # a terminal that cannot show it (LANG=C)
            self._fill = "#"

    def phase(self, text: str) -> None:
        with self._lock:
            self._text, self._since, self._kind = text, time.monotonic(), text
        self._wake.set()

    def step(self, request_id: str, step: int, total: int) -> None:
        """A ProgressCallback: step `step` of `total` is done (the last one: decoding starts)."""
        total = max(total, 1)
        done = min(max(step, 0), total)
        kind = "decoding" if done == total else "steps"
        width = 20
        filled = width * done // total
        text = f"step {done}/{total} |{self._fill * filled}{' ' * (width - filled)}|"
        with self._lock:
            if kind != self._kind:
                self._since, self._kind = time.monotonic(), kind
            self._text = text + (" decoding" if kind == "decoding" else "")
        self._wake.set()

    def line(self, text: str) -> None:
        """Replaces the bar with `text`, a finished phase kept on its own line ("loaded digits in 2.3 s")."""
        with self._lock:
            self._text = ""
        if self.active and not self._broken:
            try:
                self.write(text + "\n")
            except (OSError, ValueError):
                self._broken = True

    def write(self, text: str) -> int:
        """Writes to the terminal above the bar (the bar's line is cleared first and redrawn later)."""
        with self._draw_lock:
            self._clear()
            self._out.write(text)  # an error here is the writer's, as it would be on the real stderr
            if text:
                self._midline = not text.endswith("\n")  # a line in the making: no redraw until it ends
            self._out.flush()
        return len(text)

    def _clear(self) -> None:
        if self._shown and not self._broken:
            self._shown = False
            try:
                self._out.write("\r\x1b[K")
            except (OSError, ValueError):
                self._broken = True

    def _draw(self) -> None:
        with self._lock:
            text, since = self._text, self._since
        if not text:
            return
        try:
            columns = os.get_terminal_size(self._out.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = 0
        line = f"{text} {time.monotonic() - since:.1f} s"[:max(columns, 40) - 1]  # no wrap: \r returns one line
        with self._draw_lock:
            if self._broken or self._midline or (self._shown and line == self._drawn):
                return
            try:
                self._out.write(f"\r{line}\x1b[K")
                self._out.flush()
                self._shown, self._drawn = True, line
            except (OSError, ValueError):
                self._broken = True

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(0.1)  # and ten times a second for the elapsed time
            self._wake.clear()
            self._draw()

    def __enter__(self) -> "Progress":
        if not self.active:
            return self
        above = AboveBar(self, self._out)
        saved = sys.stderr
        sys.stderr = above  # warnings.warn and print(file=sys.stderr) look it up when they write
        self._restore.append(lambda: setattr(sys, "stderr", saved))
        for handler in logging.getLogger().handlers:  # basicConfig's handler holds the stderr it was given
            if isinstance(handler, logging.StreamHandler) and handler.stream is self._out:
                handler.setStream(above)
                self._restore.append(lambda h=handler: h.setStream(self._out))
        self._thread = threading.Thread(target=self._run, name="diffgraph-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.active:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=1.0)
        self._draw()  # the last state, drawn even when it came after the thread's last look
        with self._draw_lock:
            self._clear()
            try:
                self._out.flush()
            except (OSError, ValueError):
                pass
        for restore in reversed(self._restore):
            restore()


class AboveBar:
    """sys.stderr while a progress bar is up: every write goes through the bar, which clears its line first."""

    def __init__(self, bar: Progress, out: Any):
        self._bar, self._out = bar, out

    def write(self, text: str) -> int:
        return self._bar.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding ...: the terminal's
        return getattr(self._out, name)


def progress_for(args: argparse.Namespace) -> Progress:
    """A bar on stderr when it is a terminal and not --quiet; an inert one otherwise (CI, pipes and logs get the
    output they always had)."""
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced stderr without isatty, or a closed one
        terminal = False
    return Progress(sys.stderr if terminal and not getattr(args, "quiet", False) else None)


def post_once(target: str, **send: Any) -> tuple[int, str, Any]:
    """One POST: (status, the reason phrase of a failure, the JSON body or None)."""
    import httpx

    return answer(httpx.post(target, **send))


def answer(response: Any) -> tuple[int, str, Any]:
    status = response.status_code
    try:
        answer = response.json()
    except ValueError:
        answer = None
    return status, "" if status == 200 else response.reason_phrase, answer


def post_streaming(target: str, progress: Progress, **send: Any) -> tuple[int, str, Any]:
    """A POST with "stream": true (server/stream.py's shape). The server's progress comment lines move the bar;
    the answer is what a plain POST would give: its completed events joined, or an `error` event's status and
    error (an error before the stream starts comes as plain JSON)."""
    import httpx

    from .image_events import COMPLETIONS, join_completed

    done: list[dict[str, Any]] = []
    with httpx.stream("POST", target, **send) as response:
        if response.status_code != 200 or "text/event-stream" not in response.headers.get("content-type", ""):
            response.read()
            return answer(response)
        event = None
        for line in response.iter_lines():
            try:
                if line.startswith(": progress "):
                    data = json.loads(line[len(": progress "):])
                    progress.step(str(data["id"]), int(data["step"]), int(data["total"]))
                elif line.startswith("event:"):
                    event = line[len("event:"):].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[len("data:"):])
                    if event in COMPLETIONS:
                        done.append(data)
                        if len(done) == int(data["n"]):
                            return 200, "", join_completed(done)
                    elif event == "error":
                        return int(data["status"]), "", data
            except (ValueError, TypeError, KeyError):  # a malformed event moves no bar and answers nothing
                continue
    return 200, "", None  # the stream ended without an answer: "answered 200 without images" below
