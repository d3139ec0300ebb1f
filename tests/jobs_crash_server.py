"""A test-side wrapper (tests/test_jobs_restart.py): runs `diffgraph serve` with one point of the job store's write
path killing the process by SIGKILL at its Nth call, so the server's own code carries no test hooks.

    python tests/jobs_crash_server.py POINT N LOG -- SERVE_FLAGS...

POINT: "write" (an image's bytes written to its temporary name, at their fsync), "replace" (before an image's
rename), "renamed" (just after it, before the commit), "commit" (an SQLite commit, before it is made), or "none".
Every completed rename of an image is appended to LOG (one final path a line), so the test can tell that no image
was stored twice. SIGUSR1 is the test's kill from outside: SIGKILL at once, at whatever the server is doing. No kill
lands between an image's rename and its LOG line (that window is the wrapper's, not the server's: a kill there, from
outside or from another thread's point, would leave a stored image that no line records).
"""

import os
import signal
import sqlite3
import sys
import threading


class Killer:
    def __init__(self, point: str, nth: int, log: str):
        self.point, self.nth, self.log, self.calls = point, nth, log, 0
        self._counting = threading.Lock()
        # held from an image's rename to its LOG line. Every kill waits for it, its own points' as much as the one from
        # outside: with two images in flight, one thread's kill (at a commit, say) could otherwise land between
        # another thread's rename and its line, leaving a stored image that no line records
        self.window = threading.Lock()

    def at(self, point: str) -> None:
        if point == self.point:
            with self._counting:
                self.calls += 1
                due = self.calls == self.nth
            if due:
                self.kill()

    def kill(self) -> None:
        with self.window:
            os.kill(os.getpid(), signal.SIGKILL)


def install(killer: Killer) -> None:
    real_replace, real_fsync, real_connect = os.replace, os.fsync, sqlite3.connect
    # the handler runs on the main thread, which may be inside the window: a thread of its own waits for it
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=killer.kill, daemon=True).start())

    def replace(src, dst, *args, **kwargs):
        image = str(dst).endswith(".png") and f"{os.sep}images{os.sep}" in str(dst)
        if image:
            killer.at("replace")
        with killer.window:
            real_replace(src, dst, *args, **kwargs)
            if image:
                with open(killer.log, "a") as f:
                    f.write(f"{dst}\n")
        if image:
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
