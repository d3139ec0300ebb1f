"""engine/replica_process.py: a replica process ends at once when its parent dies (a SIGKILLed server)."""

import os
import signal
import subprocess
import sys
import time

BOUND_S = 60  # a failure bound for the wait, never a timing assumption


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited (init reaps it)
    except FileNotFoundError:
        return False


def test_a_replica_exits_when_its_parent_is_killed():
    helper = os.path.join(os.path.dirname(__file__), "replica_parent_util.py")
    parent = subprocess.Popen([sys.executable, helper], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        time.sleep(1.0)  # the child's watch has started (imports done); a later start only finds the parent gone
        assert _alive(child)  # a live parent keeps it
        parent.send_signal(signal.SIGKILL)
        parent.wait(BOUND_S)
        deadline = time.monotonic() + BOUND_S
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the replica outlived its killed parent"
    finally:
        parent.kill()
