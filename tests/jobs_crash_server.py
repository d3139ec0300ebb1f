"""A test-side wrapper (tests/test_jobs_restart.py): runs `diffgraph serve` with one point of the job store's write
path killing the process by SIGKILL at its Nth call, so the server's own code carries no test hooks.

    python tests/jobs_crash_server.py POINT N LOG -- SERVE_FLAGS...

POINT: "write" (an image's bytes written to its temporary name, at their fsync), "replace" (before an image's
rename), "renamed" (just after it, before the commit), "commit" (an SQLite commit, before it is made), or "none".
Every completed rename of an image is appended to LOG (one final path a line), so the test can tell that no image
was stored twice.
"""

import os
import signal
import sqlite3
import sys


class Killer:
    def __init__(self, point: str, nth: int, log: str):
        self.point, self.nth, self.log, self.calls = point, nth, log, 0

    def at(self, point: str) -> None:
        if point == self.point:
            self.calls += 1
            if self.calls == self.nth:
                os.kill(os.getpid(), signal.SIGKILL)


def install(killer: Killer) -> None:
    real_replace, real_fsync, real_connect = os.replace, os.fsync, sqlite3.connect

    def replace(src, dst, *args, **kwargs):
        image = str(dst).endswith(".png") and f"{os.sep}images{os.sep}" in str(dst)
        if image:
            killer.at("replace")
        real_replace(src, dst, *args, **kwargs)
        if image:
            with open(killer.log, "a") as f:
                f.write(f"{dst}\n")
            killer.at("renamed")

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            killer.at("write")
        real_fsync(fd)

    class Connection(sqlite3.Connection):
        def commit(self):
            killer.at("commit")
            super().commit()

    def connect(*args, **kwargs):
        return real_connect(*args, factory=Connection, **kwargs)

    os.replace, os.fsync, sqlite3.connect = replace, fsync, connect


if __name__ == "__main__":
    point, nth, log, sep, *flags = sys.argv[1:]
    assert sep == "--"
    install(Killer(point, int(nth), log))
    from diffgraph.server.cli import main

    sys.exit(main(flags))
