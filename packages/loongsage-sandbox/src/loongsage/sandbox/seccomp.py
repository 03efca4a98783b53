"""The system-call filter of every jail: the kernel's key management calls fail, all else runs.

Why: keyrings are not namespaced by anything bubblewrap unshares. A process inherits its parent's
*session* keyring (a worker started from an SSH login or a systemd service has one, holding the
host's keys), and every uid has a *user* keyring that outlives its processes, so without a filter a
jail could read the host's keys, plant keys another sandbox reads, and leave a note in its uid's
user keyring for the next trajectory that gets the same uid. Code under test has no use for
keyrings, so ``add_key``, ``request_key`` and ``keyctl`` fail with ``ENOSYS`` (what a kernel built
without keys answers, which libraries handle as "no keyring here").

The filter is a classic BPF program (``struct sock_filter``, 8 bytes an instruction) that
bubblewrap loads with ``--seccomp FD`` just before it starts the jail's first program, so it holds
for every process of the jail. It checks the architecture first: a system call made through
another ABI (32-bit ``int 0x80`` on x86-64, AArch32 on arm64) has other numbers and would slip past
the number checks, so any such call kills the process, and so does an x32 call on x86-64 (numbers
with bit 30 set).
"""

from __future__ import annotations

import errno
import platform
import struct

# AUDIT_ARCH_* of <linux/audit.h>, and the machine's numbers of add_key, request_key, keyctl
ARCHES: dict[str, tuple[int, tuple[int, int, int]]] = {
    "x86_64": (0xC000003E, (248, 249, 250)),
    "aarch64": (0xC00000B7, (217, 218, 219)),  # the generic table, shared by riscv64
    "riscv64": (0xC00000F3, (217, 218, 219)),
}
X32_SYSCALL_BIT = 0x40000000
DENIED_ERRNO = errno.ENOSYS

# opcodes of <linux/filter.h> and return values of <linux/seccomp.h>
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: load 32 bits of struct seccomp_data
_JEQ_K, _JGE_K = 0x15, 0x35  # BPF_JMP | BPF_JEQ / BPF_JGE | BPF_K
_RET_K = 0x06
_KILL_PROCESS, _ERRNO, _ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_NR, _ARCH = 0, 4  # offsets of nr and arch in struct seccomp_data


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def keyring_filter(machine: str | None = None) -> bytes:
    """The compiled filter for ``machine`` (``platform.machine()`` by default).

    ValueError naming the machine when no table is known for it (the jail refuses to run then,
    rather than run without the filter)."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise ValueError(f"no system-call filter for machine {machine!r}: known are {', '.join(ARCHES)}")
    arch, numbers = ARCHES[machine]
    prog = [_op(_LD_W_ABS, _ARCH), _op(_JEQ_K, arch, jt=1), _op(_RET_K, _KILL_PROCESS), _op(_LD_W_ABS, _NR)]
    if machine == "x86_64":
        prog += [_op(_JGE_K, X32_SYSCALL_BIT, jf=1), _op(_RET_K, _KILL_PROCESS)]
    for i, nr in enumerate(numbers):  # a match jumps over the other checks and the allow, to the deny
        prog.append(_op(_JEQ_K, nr, jt=len(numbers) - i))
    prog += [_op(_RET_K, _ALLOW), _op(_RET_K, _ERRNO | DENIED_ERRNO)]
    return b"".join(prog)
