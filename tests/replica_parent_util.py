"""A stand-in server for tests/test_replica_process.py: starts a replica-like child the way ReplicaClient does (a
spawned process handed this process's pid, watching it with `watch_parent`), prints the child's pid, then waits to
be killed."""

import multiprocessing
import os
import sys
import time


def child(parent_pid: int) -> None:
    from diffgraph.engine.replica_process import watch_parent

    watch_parent(parent_pid)
    time.sleep(600)  # a replica busy (building, stepping): only the watch ends it


if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=child, args=(os.getpid(),), daemon=True)
    process.start()
    print(process.pid, flush=True)
    sys.stdin.read()  # until killed
