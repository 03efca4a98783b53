"""Leaves a daemon behind: a grandchild in a session of its own that ignores SIGTERM."""

import os
import signal
import time


def note(role):
    open(os.path.join(os.environ["PIDS_DIR"], f"{role}-{os.getpid()}"), "w").close()


if os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:  # the daemon: re-parented once its parent exits
        note("daemon")
        while True:
            time.sleep(3600)
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
note("parent")
while True:
    time.sleep(3600)
