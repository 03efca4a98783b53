"""Writes to stdout without end."""

import os
import sys

open(os.path.join(os.environ["PIDS_DIR"], f"flooder-{os.getpid()}"), "w").close()
print("flooding", file=sys.stderr, flush=True)
block = b"x" * 65536
while True:
    sys.stdout.buffer.write(block)
