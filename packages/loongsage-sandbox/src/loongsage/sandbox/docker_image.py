"""The docker backend's engine: reaching it, the default image it imports, and what a container mounts.

The default image is a skeleton built here, one layer (a few empty directories, the links of a
merged ``/usr``, ``passwd``/``group``/``hosts``), imported once per engine and found again by its
content's tag; a container of it binds the host's ``/usr`` and the loader's files read-only, the
same view as the ``local`` jail.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
from typing import Any

from loongsage.sandbox.jail import ETC_PATHS, SYSTEM_PATHS, WORK

SANDBOX_UID = 1000  # the base image's user; the one uid of every sandbox where uids are not claimed
BASE_REPOSITORY = "loongsage-sandbox-base"
INSTALL_HINT = "pip install 'loongsage-sandbox[docker]'"


def engine_client(base_url: str | None, timeout: float) -> Any:
    """The official client of the engine at ``base_url`` (default: DOCKER_HOST or the usual socket), answering."""
    try:
        import docker
    except ImportError:
        raise RuntimeError(f"sandbox 'docker' needs the docker Python client: {INSTALL_HINT}") from None
    try:
        client = (
            docker.DockerClient(base_url=base_url, timeout=timeout) if base_url else docker.from_env(timeout=timeout)
        )
        client.ping()
    except Exception as exc:  # noqa: BLE001 - one line naming the engine it could not reach
        where = base_url or os.environ.get("DOCKER_HOST") or "the default socket (/var/run/docker.sock)"
        raise RuntimeError(
            f"sandbox 'docker' cannot reach a Docker Engine API at {where}: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    return client


def rootless(client: Any) -> bool:
    """Whether the engine runs rootless (Docker and Podman say so among the security options)."""
    try:
        options = client.info().get("SecurityOptions") or []
    except Exception:  # noqa: BLE001 - an engine that does not say is taken for a rootful one
        return False
    return any("name=rootless" in str(o) for o in options)


def docker_problem(base_url: str | None = None) -> str | None:
    """Why the docker backend cannot run against ``base_url`` (None: it can), in one line."""
    try:
        engine_client(base_url, 10.0).close()
    except RuntimeError as exc:
        return str(exc)
    return None


def base_image_tar() -> bytes:
    """The default image's only layer: empty directories, the host's root links, a sandbox user."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.linkname, info.size = kind, mode, link, len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        for folder in ("etc", "work", "tmp", "proc", "dev", "sys", "run", "usr"):
            add(folder, tarfile.DIRTYPE, 0o755)
        for path in SYSTEM_PATHS:
            if path != "/usr" and os.path.islink(path):
                add(path.lstrip("/"), tarfile.SYMTYPE, 0o777, link=os.readlink(path))
            elif path != "/usr" and os.path.isdir(path):
                add(path.lstrip("/"), tarfile.DIRTYPE, 0o755)
        add(
            "etc/passwd",
            tarfile.REGTYPE,
            0o644,
            f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{WORK}:/bin/sh\n".encode(),
        )
        add("etc/group", tarfile.REGTYPE, 0o644, f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n".encode())
        add("etc/hosts", tarfile.REGTYPE, 0o644, b"127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n")
    return buf.getvalue()


def base_image(client: Any) -> str:
    """The default image, imported once per engine (content-addressed: the same layer, the same id)."""
    layer = base_image_tar()
    tag = hashlib.sha256(layer).hexdigest()[:16]
    for image in client.images.list():
        if any(t.split("/")[-1] == f"{BASE_REPOSITORY}:{tag}" for t in image.tags):
            return image.id
    answer = client.api.import_image_from_data(layer, repository=BASE_REPOSITORY, tag=tag)
    found = re.findall(r"sha256:[0-9a-f]{64}", str(answer))
    if not found:
        raise RuntimeError(f"sandbox 'docker': importing the base image gave no image id: {str(answer)[:200]}")
    image = client.images.get(found[-1])
    image.tag(BASE_REPOSITORY, tag)
    return image.id


def mount_roots(uid: int) -> bytes:
    """The tmpfs roots' owner and mode: ``/work`` the sandbox's, ``/tmp`` everyone's."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, mode, owner in ((WORK.lstrip("/"), 0o700, uid), ("tmp", 0o1777, 0)):
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, owner, owner
            tar.addfile(info)
    return buf.getvalue()


def host_mounts() -> dict[str, dict[str, str]]:
    """The host paths the default image binds read-only (what the ``local`` jail binds)."""
    mounts = {}
    for path in (*SYSTEM_PATHS, *ETC_PATHS):
        if os.path.exists(path) and not os.path.islink(path):
            mounts[path] = {"bind": path, "mode": "ro"}
    return mounts
