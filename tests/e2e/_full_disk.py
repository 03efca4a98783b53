"""Runs inside a private mount namespace (``unshare -rm``), where it may mount a small tmpfs: the
launcher against a disk that fills up, one that is full from the start, one that is read-only, and
then the run resumed on a disk with room again. Writes what each launch returned (exit code,
stderr, the files left, the run's log) as JSON, since the tmpfs goes with the namespace.

    python _full_disk.py <mount point> <result.json> <size KiB> <launcher argv as JSON> <common args as JSON>
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def main() -> None:
    mnt, result, size = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    launcher, common = json.loads(sys.argv[4]), json.loads(sys.argv[5])
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}k", "tmpfs", str(mnt)], check=True)
    out: dict[str, dict] = {}

    def train(key: str, *args: str) -> None:
        proc = subprocess.run(
            [*launcher, "train", "tiny/grpo_arith_cpu", f"run.output_dir={mnt}", *common, *args],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        log = mnt / "disk" / "run.log"
        out[key] = {
            "rc": proc.returncode,
            "stderr": proc.stderr,
            "files": sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*")),
            "run_log": log.read_text(errors="replace") if log.is_file() else "",
        }

    # 1. the disk fills up while step 2's checkpoint is written (one checkpoint fits, not two)
    train("fills", "run.name=disk")
    # 2. a disk full before the run writes anything
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    os.close(fd)
    train("full", "run.name=other")
    (mnt / "filler").unlink()
    # 3. a read-only output directory
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    train("read_only", "run.name=disk", "resume=true")
    # 4. room again (for three checkpoints): the run continues from the one the full disk left intact
    subprocess.run(["mount", "-o", f"remount,rw,size={3 * size}k", str(mnt)], check=True)
    train("resumed", "run.name=disk", "resume=true")
    result.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
