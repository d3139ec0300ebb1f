"""generate's progress line (issue 34, point 5): on a terminal it shows the model loading, each denoising step and
the decode, locally and from a server's SSE events with --url, then clears itself; on a pipe, or with --quiet, the
output is exactly what it was without one. The terminal is a real pseudo-terminal (the child's stderr)."""

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from PIL import Image

from diffgraph.cli_progress import progress_for
from diffgraph.server.process import ServerProcess

PROMPT = "a handwritten digit seven"
LOCAL = ["--steps", "4", "--device", "cpu", "--seed", "1"]
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
FINAL = re.compile(r"seed (\d+), \d+ ms\n")  # the line generate printed on stderr before the progress line existed


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "diffgraph.cli", "generate", *argv]


def run_on_terminal(*argv: str, timeout: float = 300) -> tuple[int, str, str]:
    """Runs generate with its stderr on a pseudo-terminal 100 columns wide: (exit code, stdout, what the terminal
    received, with the terminal's \\r\\n line ends as \\n)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(_cli(*argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=ENV)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal (it exited)
                break
            if not data:
                break
            chunks.append(data)
        else:
            proc.kill()
            pytest.fail(f"generate did not finish within {timeout} s: {b''.join(chunks)!r}")
    finally:
        os.close(master)
    out = proc.stdout.read().decode()
    proc.stdout.close()
    return proc.wait(), out, b"".join(chunks).decode().replace("\r\n", "\n")


def run_on_pipe(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(*argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, env=ENV, timeout=300)


def steps_shown(terminal: str, total: int) -> list[int]:
    return [int(s) for s in re.findall(rf"step (\d+)/{total} ", terminal)]


def after_bar(terminal: str) -> str:
    """What the terminal shows after the last redraw of the bar's line (it clears that line before printing)."""
    return terminal.rsplit("\r\x1b[K", 1)[-1]


def test_terminal_shows_loading_each_step_and_decoding(tmp_path):
    out = tmp_path / "seven.png"
    rc, stdout, terminal = run_on_terminal(PROMPT, *LOCAL, "-o", str(out))
    assert rc == 0, terminal
    assert stdout == f"{out}\n"  # stdout is not the terminal here: untouched
    assert re.search(r"\rloading digits \d+\.\d s", terminal), terminal
    assert re.search(r"\r\x1b\[Kloaded digits in \d+\.\d s\n", terminal), terminal  # kept on its own line
    shown = steps_shown(terminal, 4)
    assert shown and shown == sorted(shown) and shown[-1] == 4, terminal  # counts up to 4/4, never back
    assert re.search(r"step 4/4 \|█{20}\| decoding \d+\.\d s", terminal), terminal
    assert terminal.index("loaded digits") < terminal.index("step ") < terminal.index("decoding")
    assert FINAL.fullmatch(after_bar(terminal)).group(1) == "1", terminal  # the bar is gone, then the usual line
    assert all(len(line) < 100 for line in re.split(r"[\r\n]", terminal))  # no line wraps a 100-column terminal
    with Image.open(out) as image:
        image.load()
    # the same command on a pipe: stderr exactly as before the bar existed, and the same image
    piped = tmp_path / "piped.png"
    proc = run_on_pipe(PROMPT, *LOCAL, "-o", str(piped))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{piped}\n"
    assert FINAL.fullmatch(proc.stderr).group(1) == "1", proc.stderr  # no \r, no escape codes, no 'step'
    assert piped.read_bytes() == out.read_bytes()


def test_quiet_on_a_terminal_prints_no_bar(tmp_path):
    out = tmp_path / "quiet.png"
    rc, stdout, terminal = run_on_terminal(PROMPT, *LOCAL, "-q", "-o", str(out))
    assert rc == 0, terminal
    assert FINAL.fullmatch(terminal).group(1) == "1", terminal
    assert stdout == f"{out}\n" and out.stat().st_size > 0


def test_an_error_clears_the_bar_before_its_message(tmp_path):
    rc, _, terminal = run_on_terminal(PROMPT, "--device", "cpu", "--model", str(tmp_path / "no-such-model"), "-o",
                                      str(tmp_path / "x.png"))
    assert rc == 2
    assert "loading no-such-model" in terminal
    assert re.fullmatch(r"diffgraph: error: [^\r\n]*no-such-model[^\r\n]*\n", after_bar(terminal)), terminal


# -- --url: the bar follows the server's SSE progress events -----------------------------------------------------

@pytest.fixture(scope="module")
def server():
    s = ServerProcess(model="random:tiny")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop(timeout=30)


def test_url_on_a_terminal_shows_the_servers_steps(tmp_path, server):
    out = tmp_path / "remote.png"
    rc, stdout, terminal = run_on_terminal("a cat", "--url", server.url, "--steps", "5", "--seed", "3", "-n", "2",
                                           "-o", str(out))
    assert rc == 0, terminal
    assert stdout == f"{tmp_path / 'remote-0.png'}\n{tmp_path / 'remote-1.png'}\n"  # two images, one request
    assert f"waiting for {server.url}" in terminal
    shown = steps_shown(terminal, 5)  # one bar for both images: steps of 5, not 10
    assert shown and shown == sorted(shown) and shown[-1] == 5, terminal
    assert "decoding" in terminal
    assert FINAL.fullmatch(after_bar(terminal)).group(1) == "3", terminal
    # on a pipe: today's plain request, the same images
    proc = run_on_pipe("a cat", "--url", server.url, "--steps", "5", "--seed", "3", "-n", "2", "-o",
                       str(tmp_path / "piped.png"))
    assert proc.returncode == 0 and FINAL.fullmatch(proc.stderr).group(1) == "3", proc.stderr
    for i in range(2):
        assert (tmp_path / f"piped-{i}.png").read_bytes() == (tmp_path / f"remote-{i}.png").read_bytes()


def test_url_error_on_a_terminal_is_the_same_one_line(tmp_path, server):
    rc, _, terminal = run_on_terminal("a cat", "--url", server.url, "--steps", "0", "-o", str(tmp_path / "x.png"))
    assert rc == 2
    assert re.fullmatch(r"diffgraph: error: --steps 0 is out of range[^\r\n]*\n", after_bar(terminal)), terminal


# -- the bar itself, in-process --------------------------------------------------------------------------------

class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class BrokenTerminal(FakeTerminal):
    def write(self, text: str) -> int:
        raise OSError(5, "Input/output error")


def _wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_stderr_written_under_the_bar_clears_its_line_first(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress_for(type("Args", (), {"quiet": False})) as bar:
        bar.step("r1", 1, 2)
        _wait_for(lambda: "step 1/2" in terminal.getvalue(), "the bar was never drawn")
        print("a warning", file=sys.stderr)
        assert terminal.getvalue().endswith("\r\x1b[Ka warning\n")  # not glued to the bar
        bar.step("r1", 2, 2)
    assert sys.stderr is terminal  # given back
    assert terminal.getvalue().endswith("\r\x1b[K")  # and the bar's line cleared
    assert "step 2/2" in terminal.getvalue().rsplit("a warning\n", 1)[1]  # redrawn below the warning


def test_a_terminal_that_fails_never_fails_the_callbacks(monkeypatch):
    monkeypatch.setattr(sys, "stderr", BrokenTerminal())
    with progress_for(type("Args", (), {"quiet": False})) as bar:
        assert bar.active
        bar.phase("loading digits")
        for i in range(1, 4):
            bar.step("r1", i, 3)
        bar.line("loaded digits in 0.1 s")


def test_no_bar_when_stderr_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress_for(type("Args", (), {"quiet": False})).active
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    assert not progress_for(type("Args", (), {"quiet": True})).active

