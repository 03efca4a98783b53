"""``loongsage doctor``: what a run on this machine will need, checked, one line each with its fix.

The machine's own checks (Python, torch, Ray, shared memory; with ``--gpu`` CUDA, the driver, the
GPUs torch and Ray see, NCCL) are here; a backend's needs are its own, declared on its factory
(``doctor()``, :class:`~loongsage.core.contracts.Trainer` and the other backend contracts) and read
off the registry, so the core names no plugin's library. A capability asked for (``--gpu``,
``--sglang``, ``--megatron``, ``--sandbox``) whose checks fail makes the exit status non-zero; the
rest is reported, not required.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from loongsage.core.types import Check

MIN_PYTHON = (3, 11)
SHM_GIB = 2.0  # below this Ray's object store falls back to disk (slow) or fails for large batches


@dataclass(frozen=True)
class Capability:
    """A capability a run may need: the backend entry that provides it and the package to install."""

    category: str
    entry: str
    package: str


CAPABILITIES: dict[str, Capability] = {
    "sglang": Capability("engine", "sglang", "loongsage-sglang"),
    "megatron": Capability("trainer", "megatron", "loongsage-megatron"),
    "sandbox": Capability("sandbox", "local", "loongsage-sandbox"),
}
"""The backend capabilities ``doctor`` can be asked for (``--gpu`` is the machine's own)."""
OPTIONAL: dict[str, Capability] = {"docker sandbox": Capability("sandbox", "docker", "loongsage-sandbox")}
"""Backends reported when installed, never required."""


def version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def python_check() -> Check:
    found = platform.python_version()
    ok = sys.version_info[:2] >= MIN_PYTHON
    return Check("python", ok, found, "" if ok else f"use Python {'.'.join(map(str, MIN_PYTHON))} or newer")


def torch_check() -> Check:
    import torch

    return Check("torch", True, f"{torch.__version__} (CUDA build {torch.version.cuda or 'none: CPU only'})")


def ray_check() -> Check:
    found = version_of("ray")
    return Check("ray", found is not None, found or "not installed", "" if found else "pip install ray")


def shm_check() -> Check:
    """Free space of /dev/shm, where Ray keeps its object store (weights pushed on the CPU, batches)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return Check("shared memory", False, "/dev/shm is missing", "mount a tmpfs on /dev/shm")
    free = stat.f_bavail * stat.f_frsize / 2**30
    ok = free >= SHM_GIB
    fix = "" if ok else f"give /dev/shm at least {SHM_GIB:g} GiB (in a container: --shm-size=16g or --ipc=host)"
    return Check("shared memory", ok, f"/dev/shm {free:.1f} GiB free", fix)


def driver_version() -> str | None:
    path = "/proc/driver/nvidia/version"
    if os.path.exists(path):
        with open(path) as f:
            first = f.readline()
        words = first.split()
        for i, word in enumerate(words):  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  ..."
            if word == "Module" and i + 1 < len(words):
                return words[i + 1]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    run = subprocess.run(
        [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
    )
    return run.stdout.splitlines()[0].strip() if run.returncode == 0 and run.stdout.strip() else None


def ray_gpus() -> int | None:
    """The GPUs Ray would give this node, detected as Ray does at start (without starting it)."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        return int(get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators())
    except Exception:  # Ray's detection is internal API: missing here means unknown, not none
        return None


def gpu_checks() -> list[Check]:
    import torch

    checks = []
    driver = driver_version()
    checks.append(
        Check("NVIDIA driver", driver is not None, driver or "not found", "" if driver else "install the NVIDIA driver")
    )
    if torch.version.cuda is None:
        checks.append(
            Check(
                "CUDA in torch", False, "this torch is a CPU build", "install a CUDA build of torch (PyPI's on Linux)"
            )
        )
        return checks
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    checks.append(
        Check(
            "GPUs (torch)",
            count > 0,
            f"{count} x {', '.join(names)}" if count else "none visible",
            "" if count else f"check the driver and CUDA_VISIBLE_DEVICES ({visible or 'unset'})",
        )
    )
    seen = ray_gpus()
    checks.append(
        Check(
            "GPUs (Ray)",
            seen is None or seen > 0,
            "unknown (Ray's detection failed)" if seen is None else str(seen),
            "" if seen is None or seen > 0 else "Ray sees no GPU: check CUDA_VISIBLE_DEVICES and nvidia-smi",
        )
    )
    import torch.distributed as dist

    nccl = dist.is_available() and dist.is_nccl_available()
    found = ".".join(map(str, torch.cuda.nccl.version())) if nccl else "not in this torch"
    checks.append(Check("NCCL", nccl, found, "" if nccl else "install a CUDA build of torch with NCCL"))
    return checks


def backend_checks(name: str, capability: Capability, registry) -> list[Check]:  # noqa: ANN001
    """The checks a backend declares, or one saying its package is missing."""
    from loongsage.core.types import ConfigError

    try:
        entry = registry.entry(capability.category, capability.entry)
    except ConfigError:
        return [Check(f"{name}: {capability.package}", False, "not installed", f"pip install {capability.package}")]
    version = version_of(capability.package)
    checks = [Check(f"{name}: {capability.package}", True, version or entry.provider)]
    if entry.doctor is not None:
        with warnings.catch_warnings():  # a library's import-time warnings are not the machine's state
            warnings.simplefilter("ignore")
            checks += [dataclasses.replace(c, name=f"{name}: {c.name}") for c in entry.doctor()]
    return checks


def diagnose(asked: set[str], registry) -> list[tuple[Check, bool]]:  # noqa: ANN001
    """``(check, required)`` for every check, in the order printed."""
    rows = [(check(), True) for check in (python_check, torch_check, ray_check)]
    rows.append((shm_check(), False))
    rows += [(c, "gpu" in asked) for c in gpu_checks()]
    for name, capability in CAPABILITIES.items():
        rows += [(c, name in asked and not c.optional) for c in backend_checks(name, capability, registry)]
    for name, capability in OPTIONAL.items():
        if capability.entry in registry.names(capability.category):
            rows += [(c, False) for c in backend_checks(name, capability, registry)]
    return rows


def report(asked: set[str], registry, out: Callable[[str], None] = print) -> int:  # noqa: ANN001
    """Print one line per check; 1 when a check of a capability asked for fails, else 0."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "no CUDA runtime" on CPUs
    rows = diagnose(asked, registry)
    width = max(len(c.name) for c, _ in rows)
    failed = []
    for check, required in rows:
        mark = "ok" if check.ok else ("FAIL" if required else "--")
        line = f"{mark:<4}  {check.name:<{width}}  {check.found}"
        out(line + (f"  -> {check.fix}" if not check.ok and check.fix else ""))
        if required and not check.ok:
            failed.append(check.name)
    wanted = ", ".join(f"--{a}" for a in sorted(asked)) or "nothing beyond the machine"
    if failed:
        out(f"doctor: asked for {wanted}; missing: {'; '.join(failed)}")
        return 1
    out(f"doctor: asked for {wanted}; all present (lines marked -- are optional here)")
    return 0
