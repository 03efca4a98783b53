"""What one sandbox may use, and how each limit is enforced.

Per process (``setrlimit`` through ``prlimit`` in the jail, before the command's uid is dropped):
CPU seconds, address space, file size, open files, no core dumps. Per sandbox: processes
(``RLIMIT_NPROC`` counts the processes of a *uid*, and every sandbox runs under a uid of its own,
so the count is the sandbox's), the work directory's size (a tmpfs of ``work_mb``), ``/tmp``'s size
(a tmpfs of ``tmp_mb``), the files each of those may hold (``inodes_per_mb``), pseudo-terminals (a
devpts instance of its own with ``max=ptys``), and each stream of captured output (``output_bytes``).
Wall-clock time is the ``timeout`` of each exec.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 60
    """CPU seconds per process (SIGXCPU, then SIGKILL)."""
    memory_mb: int = 1024
    """Address space per process (``RLIMIT_AS``): allocations beyond it fail."""
    processes: int = 128
    """Processes and threads of the sandbox at once (``RLIMIT_NPROC`` of its own uid)."""
    file_size_mb: int = 64
    """Largest file a process may write (``RLIMIT_FSIZE``: SIGXFSZ / EFBIG)."""
    open_files: int = 256
    """Open descriptors per process (``RLIMIT_NOFILE``)."""
    work_mb: int = 256
    """Size of the work directory (a tmpfs: what the sandbox writes there is in memory)."""
    tmp_mb: int = 64
    """Size of the private ``/tmp`` (a tmpfs)."""
    output_bytes: int = 1 << 20
    """Captured bytes per stream (stdout, stderr) of one exec; beyond it the head and tail are kept."""
    get_bytes: int = 256 << 20
    """Largest file ``get`` returns (and largest ``put``/archive it accepts)."""
    inodes_per_mb: int = 256
    """Files, directories and links per MiB of ``work_mb`` and of ``tmp_mb`` (the tmpfs ``nr_inodes``).
    An empty file costs no space but about 1 KiB of kernel memory that ``size=`` does not count;
    256 per MiB keeps that under a quarter of the size cap (16 MiB: 4,096 entries)."""
    ptys: int = 16
    """Pseudo-terminals the sandbox may hold at once (``max=`` of its devpts). The kernel has 3,072
    for all devpts instances together (``kernel.pty.max`` less ``kernel.pty.reserve``), so sandboxes
    live at once times ``ptys`` should stay below that for one never to starve another."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"sandbox limit {f.name}={value!r}: must be a positive integer")
        if self.processes < 2:
            raise ValueError(
                f"sandbox limit processes={self.processes}: must be at least 2 (the shell and one command)"
            )

    def inodes(self, size_mb: int) -> int:
        """``nr_inodes`` of a tmpfs of ``size_mb`` (its root directory counts as one)."""
        return size_mb * self.inodes_per_mb

    def prlimit_args(self) -> list[str]:
        """The ``prlimit`` options that set the per-process limits (soft = hard: no raising back)."""
        return [
            f"--cpu={self.cpu_s}",
            f"--as={self.memory_mb * MIB}",
            f"--nproc={self.processes}",
            f"--fsize={self.file_size_mb * MIB}",
            f"--nofile={self.open_files}",
            "--core=0",
        ]
