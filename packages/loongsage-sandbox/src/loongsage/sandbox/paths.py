"""Files in and out of a work directory, never anywhere else.

A path is relative, made of plain names (no ``..``, ``.`` or empty parts, no NUL), and walked one
component at a time from a descriptor of the work directory with ``O_NOFOLLOW``: a symlink
anywhere on the way (the sandbox may plant one pointing at ``/etc``) fails the call instead of
being followed, so no check-then-use race exists. Only regular files are read or written (a FIFO
the sandbox made cannot block the host: files are opened non-blocking and checked). The work
directory is a file system of its own, so the sandbox cannot hard-link a host file into it either.

Names are ``str`` as the rest of Python sees them: a non-UTF-8 name is written with surrogate
escapes (``os.fsdecode``) and reaches the disk as its original bytes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import tarfile
from collections.abc import Iterator

FILE_MODE = 0o644
DIR_MODE = 0o755


def split(path: str) -> list[bytes]:
    """The components of a path relative to the work directory, or ValueError saying what is wrong."""
    if not isinstance(path, str):
        raise ValueError(f"sandbox path {path!r}: must be a str relative to the work directory")
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ValueError(f"sandbox path {path!r}: contains a NUL byte")
    if raw.startswith(b"/"):
        raise ValueError(f"sandbox path {path!r}: absolute; give a path relative to the work directory")
    parts = [p for p in raw.split(b"/") if p not in (b"", b".")]
    if any(p == b".." for p in parts):
        raise ValueError(f"sandbox path {path!r}: '..' is not allowed; paths stay inside the work directory")
    if not parts:
        raise ValueError(f"sandbox path {path!r}: names no file (empty, or the work directory itself)")
    return parts


@contextlib.contextmanager
def _walk(root: str, parts: list[bytes], *, create: bool, uid: int, path: str) -> Iterator[int]:
    """A descriptor of the directory holding ``parts[-1]`` (parents made when ``create``)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in parts[:-1]:
            if create:
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=fd)
                    os.chown(name, uid, uid, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise _refuse(path, exc, f"'{os.fsdecode(name)}' is not a directory") from None
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _refuse(path: str, exc: OSError, what: str) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return ValueError(f"sandbox path {path!r}: {what} or is a symlink; symlinks are not followed")
    if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without a reader, a directory
        return ValueError(f"sandbox path {path!r}: not a regular file; only regular files are written")
    if exc.errno == errno.ENOENT:
        return FileNotFoundError(f"sandbox path {path!r}: no such file in the work directory")
    return exc


def write_file(root: str, path: str, data: bytes, *, uid: int, limit: int) -> None:
    """``data`` into ``root/path`` as a regular file owned by ``uid`` (replaced if it exists)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"sandbox put {path!r}: data must be bytes, not {type(data).__name__}")
    if len(data) > limit:
        raise ValueError(f"sandbox put {path!r}: {len(data)} bytes is over the limit of {limit}")
    parts = split(path)
    with _walk(root, parts, create=True, uid=uid, path=path) as parent:
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         FILE_MODE, dir_fd=parent)
        except OSError as exc:
            raise _refuse(path, exc, "the file") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"sandbox path {path!r}: not a regular file; only regular files are written")
        with open(fd, "wb", closefd=True) as f:
            os.ftruncate(fd, 0)
            os.fchown(fd, uid, uid)
            f.write(data)


def read_file(root: str, path: str, *, limit: int) -> bytes:
    """The bytes of the regular file ``root/path``."""
    parts = split(path)
    with _walk(root, parts, create=False, uid=-1, path=path) as parent:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            raise _refuse(path, exc, "the file") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise ValueError(f"sandbox path {path!r}: not a regular file; only regular files are read")
        with open(fd, "rb", closefd=True) as f:
            if info.st_size > limit:
                raise ValueError(f"sandbox get {path!r}: {info.st_size} bytes is over the limit of {limit}")
            data = f.read(limit + 1)
            if len(data) > limit:  # grown while read
                raise ValueError(f"sandbox get {path!r}: over the limit of {limit} bytes")
            return data


def extract_archive(root: str, path: str, archive: bytes, *, uid: int, limit: int) -> int:
    """The tar ``archive`` unpacked under ``root/path`` (``"."``: the work directory itself).

    Only directories and regular files are accepted; every member's name follows the rules of
    :func:`split`. The whole archive is checked before anything is written: a link, a device, a
    FIFO, an absolute or ``..`` name, or more than ``limit`` bytes refuses all of it. Returns the
    number of files written.
    """
    base = [] if path in ("", ".") else split(path)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(archive), mode="r:*")
    except tarfile.TarError as exc:
        raise ValueError(f"sandbox archive for {path!r}: not a readable tar archive ({exc})") from None
    with tar:
        members = tar.getmembers()
        total = 0
        for m in members:
            if not (m.isreg() or m.isdir()):
                kind = "symlink" if m.issym() else "hard link" if m.islnk() else "device or FIFO"
                raise ValueError(f"sandbox archive member {m.name!r}: a {kind}; only files and directories are allowed")
            split(m.name)
            total += m.size
            if total > limit:
                raise ValueError(f"sandbox archive for {path!r}: more than {limit} bytes of files")
        written = 0
        for m in members:
            name = os.fsdecode(b"/".join([*base, *split(m.name)]))
            if m.isdir():
                write_dir(root, name, uid=uid)
                continue
            source = tar.extractfile(m)
            write_file(root, name, source.read() if source else b"", uid=uid, limit=limit)
            written += 1
    return written


def write_dir(root: str, path: str, *, uid: int) -> None:
    parts = split(path)
    with _walk(root, [*parts, b"."], create=True, uid=uid, path=path):
        pass


def give_files(root: str, uid: int) -> int:
    """Make everything under ``root`` belong to ``uid`` (files a program on the host wrote into a
    sandbox's work directory, so the sandbox may change them); how many entries changed owner.
    Walked by descriptor without following a symlink: a link is re-owned itself, never its target."""
    count = 0
    for _, dirs, files, dir_fd in os.fwalk(root, follow_symlinks=False):
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):
                if os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_uid != uid:
                    os.chown(name, uid, uid, dir_fd=dir_fd, follow_symlinks=False)
                    count += 1
    return count
