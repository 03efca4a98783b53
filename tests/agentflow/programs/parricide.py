"""Kills its supervisor, then stays, deaf to SIGTERM."""

import os
import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(os.environ["PIDS_DIR"], f"parricide-{os.getpid()}"), "w").close()
os.kill(os.getppid(), signal.SIGKILL)
while True:
    time.sleep(3600)
