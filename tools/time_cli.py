"""Wall-clock time of the command line, each run a fresh process: min / median / max of N runs.

    python tools/time_cli.py [--runs 5] [--port P]

Measures `diffgraph --help`, `diffgraph models`, the import floor `python -c "import torch, diffusers,
transformers"`, a local `diffgraph generate` (the default digits model on the CPU: imports, model load and
20 steps), and `diffgraph generate --url` against a server this script starts
(`python -m diffgraph.server.cli --model digits --device cpu --port P`; it waits for GET /ready == 200 and
sends SIGTERM at the end). The local commands run round-robin (one run of each per round, so a change in
the machine's load touches all of them alike) before the server starts, so an idle server does not share
the CPU with them. Prints a markdown table (wall seconds, and the median CPU seconds of the process, which a
loaded machine disturbs less), the exact command lines and the load average.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

PROMPT = "a handwritten digit seven"
FLOOR = "import floor (torch, diffusers, transformers)"
GENERATE = "`diffgraph generate` (digits, CPU, 20 steps)"


def _script(name: str) -> str:
    """The console script installed beside this Python (the venv's `diffgraph`)."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(path):
        sys.exit(f"time_cli: {path} not found; install the package (pip install -e .) in this environment")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped children only: not the running server
    return usage.ru_utime + usage.ru_stime


def _run_once(argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s: user + system of the process) of one run."""
    cpu0, t0 = _cpu_s(), time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elapsed, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    if proc.returncode != 0:
        sys.exit(f"time_cli: {shlex.join(argv)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return elapsed, cpu


def _measure(commands: dict[str, list[str]], runs: int) -> dict[str, list[tuple[float, float]]]:
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            times[name].append(_run_once(argv))
    return times


def _get_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _server_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "diffgraph.server.cli", "--model", "digits", "--device", "cpu", "--port", str(port)]


def _start_server(port: int, log: str, timeout_s: float) -> subprocess.Popen:
    argv = _server_argv(port)
    with open(log, "w") as f:
        server = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while _get_status(f"http://127.0.0.1:{port}/ready") != 200:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            with open(log) as f:
                tail = f.read()[-3000:]
            sys.exit(f"time_cli: the server ({shlex.join(argv)}) did not become ready:\n{tail}")
        time.sleep(0.5)
    return server


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)  # drains, then exits 0
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="fresh processes per command (default 5)")
    p.add_argument("--port", type=int, default=None, help="port of the server started for --url (default: a free one)")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for the server's /ready")
    args = p.parse_args(argv)

    diffgraph = _script("diffgraph")
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    local = {
        "`diffgraph --help`": [diffgraph, "--help"],
        "`diffgraph models`": [diffgraph, "models"],
        FLOOR: [sys.executable, "-c", "import torch, diffusers, transformers"],
        GENERATE: [diffgraph, "generate", PROMPT, "-o", "/tmp/x.png", "--seed", "1"],
    }
    remote = {"`diffgraph generate --url` (server: digits, CPU)":
              [diffgraph, "generate", PROMPT, "-o", "/tmp/x-url.png", "--seed", "1", "--url", url]}

    load_before = os.getloadavg()
    times = _measure(local, args.runs)
    with tempfile.NamedTemporaryFile(prefix="diffgraph-time-cli-", suffix=".log", delete=False) as f:
        log = f.name
    server = _start_server(port, log, args.ready_timeout)
    try:
        times.update(_measure(remote, args.runs))
    finally:
        _stop(server)
    os.unlink(log)
    load_after = os.getloadavg()

    print(f"{args.runs} fresh processes per command; {os.cpu_count()} CPU cores; load average (1 min) "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    print("| command | min s | median s | max s | median CPU s |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in times.items():
        wall = [w for w, _ in runs]
        cpu = statistics.median(c for _, c in runs)
        print(f"| {name} | {min(wall):.2f} | {statistics.median(wall):.2f} | {max(wall):.2f} | {cpu:.2f} |")

    def median_wall(name: str) -> float:
        return statistics.median(w for w, _ in times[name])

    gap = median_wall(GENERATE) - median_wall(FLOOR)
    print(f"\n`diffgraph generate` minus the import floor (median wall): {gap:+.2f} s")
    print("CPU s: user + system time of the command's own process (for --url: the client's, not the server's)\n")
    print("Command lines:\n")
    for argv_ in {**local, **remote}.values():
        print(f"    {shlex.join(argv_)}")
    print(f"    server: {shlex.join(_server_argv(port))}")
    this = ["tools/time_cli.py", *(argv if argv is not None else sys.argv[1:])]
    print(f"    (this table: python {shlex.join(this)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
