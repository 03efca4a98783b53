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
import secrets
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
            fd = os.open(
                parts[-1],
                os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                FILE_MODE,
                dir_fd=parent,
            )
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

    All or nothing: only directories and regular files are accepted, every member's name follows
    the rules of :func:`split`, and the whole archive is checked before anything is written (a
    link, a device, a FIFO, an absolute or ``..`` name, a name that is both a file and a directory,
    more than ``limit`` bytes, or a path where the work directory has something else: a symlink, a
    file where a directory goes, refuses all of it). Files are then written into a staging
    directory of root's on the same tmpfs and only moved into place (a rename each) once all of
    them are written, so a full work directory also refuses the whole archive. Returns the number
    of files written.
    """
    base = [] if path in ("", ".") else split(path)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(archive), mode="r:*")
    except tarfile.TarError as exc:
        raise ValueError(f"sandbox archive for {path!r}: not a readable tar archive ({exc})") from None
    with tar:
        plan = _plan(tar.getmembers(), base, path, limit)
        root_fd = os.open(root, _DIR_FLAGS)
        try:
            missing = _absent(root_fd, plan, path)
            stage, stage_fd = _stage(root_fd, tar, plan, uid, path)
            try:
                _place(root, plan, missing, stage_fd, uid=uid, path=path)
            finally:
                _unstage(root_fd, stage, stage_fd)
        finally:
            os.close(root_fd)
    return sum(1 for member in plan.values() if member is not _DIR)


_DIR = object()  # a planned directory (a file is planned as its tar member)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _plan(members: list[tarfile.TarInfo], base: list[bytes], path: str, limit: int) -> dict[tuple[bytes, ...], object]:
    """Every path the archive makes (its directories, the ones above its members, its files; of
    a file named twice the last wins, as tar does), or ValueError on the first bad member."""
    plan: dict[tuple[bytes, ...], object] = {tuple(base[:i]): _DIR for i in range(1, len(base) + 1)}
    total = 0
    for m in members:
        if not (m.isreg() or m.isdir()):
            kind = "symlink" if m.issym() else "hard link" if m.islnk() else "device or FIFO"
            raise ValueError(f"sandbox archive member {m.name!r}: a {kind}; only files and directories are allowed")
        parts = (*base, *split(m.name))
        total += m.size
        if total > limit:
            raise ValueError(f"sandbox archive for {path!r}: more than {limit} bytes of files")
        for i in range(len(base) + 1, len(parts) + 1):
            is_dir = i < len(parts) or m.isdir()
            before = plan.get(parts[:i])
            if before is not None and (before is _DIR) != is_dir:
                raise ValueError(
                    f"sandbox archive member {m.name!r}: {os.fsdecode(b'/'.join(parts[:i]))!r} is both "
                    f"a file and a directory in the archive"
                )
            plan[parts[:i]] = _DIR if is_dir else m
    return plan


def _absent(root_fd: int, plan: dict[tuple[bytes, ...], object], path: str) -> set[tuple[bytes, ...]]:
    """The planned paths the work directory does not have yet; ValueError when it has one as
    something else than planned (a symlink, which is never followed, counts as something else)."""
    missing: set[tuple[bytes, ...]] = set()
    for parts in sorted(plan, key=len):  # a directory before what is in it: every parent checked already
        if parts[:-1] in missing:
            missing.add(parts)
            continue
        name = b"/".join(parts)
        try:
            mode = os.lstat(name, dir_fd=root_fd).st_mode
        except FileNotFoundError:
            missing.add(parts)
            continue
        except OSError as exc:
            raise ValueError(
                f"sandbox archive for {path!r}: cannot check {os.fsdecode(name)!r} "
                f"({exc.strerror}); nothing was written"
            ) from None
        want_dir = plan[parts] is _DIR
        if stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode):
            continue
        there = (
            "a symlink"
            if stat.S_ISLNK(mode)
            else "a directory"
            if stat.S_ISDIR(mode)
            else "a regular file"
            if stat.S_ISREG(mode)
            else "a special file"
        )
        raise ValueError(
            f"sandbox archive for {path!r}: {os.fsdecode(name)!r} is {there} in the work directory, "
            f"the archive has a {'directory' if want_dir else 'file'} there; nothing was written"
        )
    return missing


def _stage(root_fd: int, tar: tarfile.TarFile, plan: dict, uid: int, path: str) -> tuple[bytes, int]:
    """Every file of the plan written into a new directory of root's (mode 0700: the sandbox cannot
    enter it) at the top of the work directory, named by its index in the plan."""
    stage = f".unpack-{secrets.token_hex(6)}".encode()
    os.mkdir(stage, 0o700, dir_fd=root_fd)
    stage_fd = os.open(stage, _DIR_FLAGS, dir_fd=root_fd)
    try:
        info = os.fstat(stage_fd)
        if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:  # swapped by the sandbox meanwhile
            raise ValueError(f"sandbox archive for {path!r}: its staging directory was replaced; nothing was written")
        for index, member in enumerate(plan.values()):
            if member is _DIR:
                continue
            source = tar.extractfile(member)
            data = source.read() if source else b""
            fd = os.open(
                str(index),
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                FILE_MODE,
                dir_fd=stage_fd,
            )
            with open(fd, "wb", closefd=True) as f:
                os.fchown(fd, uid, uid)
                f.write(data)
    except BaseException as exc:
        _unstage(root_fd, stage, stage_fd)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ValueError(
                f"sandbox archive for {path!r}: does not fit in the work directory "
                f"({exc.strerror}); nothing was written"
            ) from None
        raise
    return stage, stage_fd


def _place(root: str, plan: dict, missing: set, stage_fd: int, *, uid: int, path: str) -> None:
    """Make the planned directories the work directory lacks and move each staged file into
    place. A failure here (the sandbox changed those paths meanwhile) removes what this call made;
    a file it replaced keeps the archive's content."""
    made: list[tuple[bytes, ...]] = []
    name = path
    try:
        for index, parts in sorted(enumerate(plan), key=lambda item: len(item[1])):
            name = os.fsdecode(b"/".join(parts))
            with _walk(root, list(parts), create=False, uid=uid, path=name) as parent:
                if plan[parts] is not _DIR:
                    os.rename(str(index), parts[-1], src_dir_fd=stage_fd, dst_dir_fd=parent)
                elif parts in missing:
                    os.mkdir(parts[-1], DIR_MODE, dir_fd=parent)
                    os.chown(parts[-1], uid, uid, dir_fd=parent, follow_symlinks=False)
                else:
                    continue
            if parts in missing:
                made.append(parts)
    except BaseException as exc:
        _unplace(root, plan, made, uid=uid)
        if isinstance(exc, (OSError, ValueError)):
            raise ValueError(
                f"sandbox archive for {path!r}: {name!r} changed while the archive was unpacked "
                f"({exc}); what this call made was removed"
            ) from None
        raise


def _unplace(root: str, plan: dict, made: list[tuple[bytes, ...]], *, uid: int) -> None:
    """Remove the files and directories :func:`_place` made, the deepest first."""
    for parts in reversed(made):
        with (
            contextlib.suppress(OSError, ValueError),
            _walk(root, list(parts), create=False, uid=uid, path="") as parent,
        ):
            if plan[parts] is _DIR:
                os.rmdir(parts[-1], dir_fd=parent)
            else:
                os.unlink(parts[-1], dir_fd=parent)


def _unstage(root_fd: int, stage: bytes, stage_fd: int) -> None:
    """Remove the staging directory and what is left in it (nothing, once every file moved)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(stage_fd):
            os.unlink(name, dir_fd=stage_fd)
    os.close(stage_fd)
    with contextlib.suppress(OSError):
        os.rmdir(stage, dir_fd=root_fd)


def give_files(root: str, uid: int) -> int:
    """Make everything under ``root`` belong to ``uid`` (files a program on the host wrote into a
    sandbox's work directory, so the sandbox may change them); how many entries changed owner.

    Walked by descriptor without following a symlink (a link is re-owned itself, never its
    target), and without recursion or a descriptor per level: a tree of any depth holds one
    descriptor below the root, going down by name and back up by ``..``. Each step up is checked
    against the directory passed on the way down (a directory the sandbox moved meanwhile would
    lead elsewhere): then the walk starts again, and entries already handed over are not counted
    twice."""
    counted = [0]  # across walks: an entry handed over once is skipped by the next walk
    for _ in range(_WALKS):
        try:
            _give_walk(root, uid, counted)
            return counted[0]
        except _Moved:
            continue
    raise RuntimeError(
        f"sandbox adopt: directories under {root} kept moving during {_WALKS} walks; "
        f"run adopt again once nothing in the sandbox moves them"
    )


_WALKS = 3


class _Moved(Exception):
    """A step up by ``..`` did not reach the directory the walk came down from."""


def _give_walk(root: str, uid: int, counted: list[int]) -> None:
    top = fd = os.open(root, _DIR_FLAGS)
    try:
        levels = [(_identity(fd), _give_entries(fd, uid, counted))]  # per directory down to fd: its subdirectories left
        while levels:
            subdirs = levels[-1][1]
            if subdirs:
                try:
                    child = os.open(subdirs.pop(), _DIR_FLAGS, dir_fd=fd)
                except OSError:  # gone, or replaced by a file or a symlink since it was listed
                    continue
                if fd != top:
                    os.close(fd)
                fd = child
                levels.append((_identity(fd), _give_entries(fd, uid, counted)))
                continue
            levels.pop()
            if not levels:
                break
            up = top if len(levels) == 1 else os.open(b"..", _DIR_FLAGS, dir_fd=fd)
            if fd != top:
                os.close(fd)
            fd = up
            if _identity(fd) != levels[-1][0]:
                raise _Moved
    finally:
        if fd != top:
            os.close(fd)
        os.close(top)


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


def _give_entries(fd: int, uid: int, counted: list[int]) -> list[str]:
    """Hand the entries of the directory ``fd`` to ``uid``; the names of its subdirectories."""
    subdirs = []
    with os.scandir(fd) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    os.chown(entry.name, uid, uid, dir_fd=fd, follow_symlinks=False)
                    counted[0] += 1
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append(entry.name)
    return subdirs
