"""Which connections an agent program tried to open: ``strace`` over the program, read afterwards.

The loopback-only jail makes every connection outside its namespace fail at once, so a program
that tries to reach the internet (a DNS lookup, a model-catalog fetch, an update check, telemetry)
cannot, but it may still lose time retrying. The audit shows whether it tried at all: the program
runs under ``strace -f`` restricted (``--seccomp-bpf``) to the calls that name a destination
(``connect``, ``sendto``, ``sendmsg``), and the log is read back into a short report::

    {"outside": {"10.255.255.53:53": {"calls": 2, "result": "ENETUNREACH"}},  # anything not loopback, and
                                                                             # every name lookup (port 53)
     "loopback": {"127.0.0.1:43121": {"calls": 3, "result": "EINPROGRESS"}},  # the gateway's relay, local servers
     "unix": {"/var/run/nscd/socket": {"calls": 2, "result": "ENOENT"}}}     # Unix sockets (files: they cross
                                                                             # namespaces; a resolver daemon's is one)
"""

from __future__ import annotations

import functools
import ipaddress
import re
import shutil
from pathlib import Path
from typing import Any

PACKAGE_HINT = "install the 'strace' package (apt-get install -y strace)"
_CALLS = "trace=connect,sendto,sendmsg"
_INET = re.compile(r'sa_family=AF_INET, sin_port=htons\((\d+)\), sin_addr=inet_addr\("([^"]+)"\)')
_INET6 = re.compile(r'sa_family=AF_INET6, sin6_port=htons\((\d+)\).*?inet_pton\(AF_INET6, "([^"]+)"')
_UNIX = re.compile(r'sa_family=AF_UNIX, sun_path=(@?"[^"]*")')
_RESULT = re.compile(r"\) = (-?\d+)(?: (E[A-Z0-9]+))?(?: \(.*\))?$")
_MAX_KEYS = 50  # destinations kept per kind: a program sweeping ports must not flood the metadata


@functools.lru_cache(maxsize=1)
def strace_problem() -> str | None:
    """Why the audit cannot run here (None: it can)."""
    return None if shutil.which("strace") else f"strace is not on PATH: {PACKAGE_HINT}"


def traced(argv: list[str], log: str) -> list[str]:
    """``argv`` run under strace, every process it starts followed, the destinations it names written to ``log``."""
    return [
        shutil.which("strace") or "strace",
        "-f",
        "-qq",
        "--seccomp-bpf",
        "-e",
        _CALLS,
        "-e",
        "signal=none",
        "-o",
        log,
        "--",
        *argv,
    ]


def report(log: str | Path) -> dict[str, Any]:
    """The destinations the traced program named, by kind; ``error`` when no log could be read."""
    out: dict[str, Any] = {"outside": {}, "loopback": {}, "unix": {}}
    try:
        text = Path(log).read_text(errors="replace")
    except OSError as exc:
        return {**out, "error": f"no strace log: {exc}"}
    for line in text.splitlines():
        if not any(call in line for call in ("connect(", "sendto(", "sendmsg(")):
            continue
        kind, key = _destination(line)
        if kind is None:
            continue
        table = out[kind]
        if key not in table and len(table) >= _MAX_KEYS:
            key = "(more)"
        entry = table.setdefault(key, {"calls": 0, "result": None})
        entry["calls"] += 1
        result = _RESULT.search(line)  # none on a call strace shows <unfinished ...>
        if result:
            entry["result"] = result.group(2) or ("ok" if int(result.group(1)) >= 0 else "error")
    return out


def _destination(line: str) -> tuple[str | None, str]:
    if m := _INET.search(line):
        port, host = int(m.group(1)), m.group(2)
    elif m := _INET6.search(line):
        port, host = int(m.group(1)), m.group(2)
    elif m := _UNIX.search(line):
        return "unix", m.group(1).replace('"', "")
    else:
        return None, ""  # netlink and other families: no destination outside the machine
    try:
        address = ipaddress.ip_address(host)
        mapped = getattr(address, "ipv4_mapped", None)
        loopback = (mapped or address).is_loopback
    except ValueError:
        loopback = False
    key = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # a name lookup is a step towards a host elsewhere, even when the resolver it asks is local
    return ("loopback" if loopback and port != 53 else "outside"), key
