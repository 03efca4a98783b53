"""Sleeps forever."""

import os
import time

open(os.path.join(os.environ["PIDS_DIR"], f"sleeper-{os.getpid()}"), "w").close()
while True:
    time.sleep(3600)
