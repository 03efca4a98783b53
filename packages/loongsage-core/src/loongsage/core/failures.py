"""What the launcher says when a run stops: one line naming what happened and what to do.

A run that stops (an actor dies, the disk fills up, a reward raises, a signal comes) ends with one
stderr line ``loongsage: error: ...`` and an exit code; the traceback goes to the run's log
(``<run_dir>/run.log``) and nowhere else. :func:`explain` turns the exception into that line,
looking through its whole cause chain: a Ray task error carries the actor's own exception, and
torch reports a full disk as ``unexpected pos`` with the ``OSError`` lost, so that message counts
as one (the free space is reported beside it).

:func:`install_stop_handlers` makes SIGINT and SIGTERM unwind the run like an error (the
controller then shuts Ray down), so they too end in one line, with exit codes 130 and 143.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongsage.core.types import BadRecordError, ConfigError

EXIT_FAILED = 1
EXIT_CONFIG = 2


class RunError(RuntimeError):
    """A failure whose message already says, in one line, what happened (and what to do about it:
    the launcher adds how to resume unless ``resumable`` is False)."""

    resumable = True


class Stopped(SystemExit):
    """SIGTERM arrived (SIGINT comes as :class:`KeyboardInterrupt`).

    A ``SystemExit`` so that no ``except Exception`` on the way up mistakes it for a failure to
    handle, and so that asyncio lets it out of whichever task or callback the signal landed in, as
    it does a ``KeyboardInterrupt``: any other ``BaseException`` stays in that task, and the run
    would go on. Its exit code is the shell's (143 for SIGTERM) should it ever reach the top."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.code = 128 + signum


# ----------------------------------------------------------------------------- signals
_stopping: list[int] = []  # the signal being handled; a second one forces the exit


def _on_signal(signum: int, frame: Any) -> None:
    if _stopping:
        # a second signal while the run releases Ray: leave now; the launcher's watchdog
        # (cli.reap_on_abnormal_exit) kills what is left
        os._exit(128 + _stopping[0])
    _stopping.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


_previous: dict[int, Any] = {}  # the handlers before install_stop_handlers, put back by restore_previous_handlers


def install_stop_handlers() -> None:
    """SIGINT and SIGTERM unwind the main thread (a ``KeyboardInterrupt`` or :class:`Stopped`).

    Called by the launcher before the run (and again by the controller after it starts Ray, whose
    own SIGTERM handler, which kills the node's processes and calls ``sys.exit`` from inside
    whatever runs, ends the launcher with a C++ abort). Only from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return
    _stopping.clear()
    for signum in (signal.SIGINT, signal.SIGTERM):
        _previous.setdefault(signum, signal.getsignal(signum))
        signal.signal(signum, _on_signal)


def launched() -> bool:
    """Whether the launcher runs this process's run (it installed the stop handlers)."""
    return bool(_previous)


def reinstall_stop_handlers() -> None:
    """Install them again if the launcher did (after ``ray.init``, which replaces SIGTERM's)."""
    if _previous and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _on_signal)


def restore_previous_handlers() -> None:
    """Put back the handlers from before :func:`install_stop_handlers` (a test's, an embedding program's)."""
    if threading.current_thread() is threading.main_thread():
        for signum, handler in _previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    _previous.clear()
    _stopping.clear()


def quiet_stopped_tasks(loop: Any, context: dict[str, Any]) -> None:
    """An asyncio exception handler that drops a task's never-retrieved stop signal.

    The signal handler raises in whatever runs on the main thread; when that is a task other than
    the run's own (the router's flush), the task keeps the ``KeyboardInterrupt`` as its result and
    asyncio reports it when the task is collected, after the launcher's one line. The run already
    unwound from that signal and said so; anything else goes to asyncio's default handler."""
    if isinstance(context.get("exception"), KeyboardInterrupt | Stopped):
        return
    loop.default_exception_handler(context)


# ----------------------------------------------------------------------------- explaining
def _ray_wrapper(e: BaseException) -> bool:
    """Ray's task error around an actor's exception (also an instance of the exception's class)."""
    return type(e).__name__.startswith("RayTaskError")


def _walk(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what caused it, breadth first: ``__cause__``, ``__context__`` and a Ray task
    error's ``cause`` (the exception the actor raised)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [n for n in (getattr(e, "cause", None), e.__cause__, e.__context__) if isinstance(n, BaseException)]


def causes(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions of ``exc``'s chain, a Ray task error standing for the actor's exception it carries."""
    return (e for e in _walk(exc) if not _ray_wrapper(e))


# torch's zip writer reports a short write (a full disk) as this, without the OSError
_TORCH_SHORT_WRITE = re.compile(r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed writing")
_ACTOR_ROLES = {
    "TrainerWorker": "trainer",
    "EngineWorker": "engine",
    "RewardWorker": "reward",
    "CriticWorker": "critic",
    "TeacherWorker": "teacher",
}


def free_space(path: Path) -> str:
    """The free space of the file system holding ``path`` (its nearest existing parent), for messages."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown free space"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if free >= size:
            return f"{free / size:.1f} {unit} free"
    return f"{free} bytes free"


def disk_full(exc: BaseException) -> OSError | RuntimeError | None:
    """The error in ``exc``'s chain that says the disk is full: an ``OSError`` ENOSPC (or EDQUOT), or
    torch's short write."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if isinstance(e, RuntimeError) and _TORCH_SHORT_WRITE.search(str(e)):
            return e
    return None


def not_writable(exc: BaseException) -> OSError | None:
    """An ``OSError`` in ``exc``'s chain saying a path cannot be written (read-only file system,
    permission denied)."""
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return e
    return None


def out_of_gpu_memory(exc: BaseException) -> str | None:
    """torch's CUDA out-of-memory error in ``exc``'s chain, as its first sentences (what it tried
    to allocate, what the card has and holds); None: there is none."""
    for e in causes(exc):
        if type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(e):
            # the rest (allocated vs reserved, PYTORCH_CUDA_ALLOC_CONF) is for the log
            return _first_line(e).split(" Of the allocated memory")[0][:300].rstrip(".")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else ""


def _where(exc: BaseException) -> str:
    """`` (in the reward actor, RewardWorker.score)`` for an error raised in an actor, else ''. Ray's
    task error starts with the worker's process title, ``ray::RewardWorker.score() (pid=...``."""
    for e in _walk(exc):
        if _ray_wrapper(e):
            found = re.search(r"ray::(\w+)\.(\w+)\(", str(e))
            if found:
                actor, method = found.groups()
                return f" (in the {_ACTOR_ROLES.get(actor, actor)} actor, {actor}.{method})"
    return ""


def _root(exc: BaseException) -> BaseException:
    """The exception to name: the deepest one raised in an actor, else ``exc`` itself. A wrapper
    raised in the driver around it (``RuntimeError('push failed') from ...``) says less."""
    inner = [e for e in _walk(exc) if _ray_wrapper(e)]
    return inner[-1].cause if inner else exc


@dataclass
class Outcome:
    """What the launcher prints and returns for a run that stopped."""

    message: str
    code: int


def explain(
    exc: BaseException, *, run_dir: Path | None = None, step: int | None = None, total_steps: int | None = None
) -> Outcome:
    """The one line (and exit code) for ``exc``, which stopped a run in ``run_dir`` after ``step``
    steps (None: before training began). The launcher adds which log holds the traceback."""
    from loongsage.core import checkpoint as ckpt

    where = f" after {step} of {total_steps} steps" if step is not None and total_steps else ""
    latest = ckpt.latest(run_dir) if run_dir is not None and Path(run_dir).is_dir() else None
    if latest is not None:
        resume = f"run the same command with resume=true to continue from {Path(run_dir) / 'checkpoints' / latest.name}"
    else:
        resume = "run the same command with resume=true to start it again (no checkpoint was written yet)"

    if isinstance(exc, KeyboardInterrupt) or isinstance(exc, Stopped):
        name = "SIGINT" if isinstance(exc, KeyboardInterrupt) else signal.Signals(exc.signum).name
        code = 128 + (signal.SIGINT if isinstance(exc, KeyboardInterrupt) else exc.signum)
        address = os.environ.get("RAY_ADDRESS")
        ray = f"its actors on the Ray cluster at {address} were stopped" if address else "Ray was shut down"
        return Outcome(f"stopped by {name}{where}; {ray}; {resume}", code)

    for e in causes(exc):
        if isinstance(e, (ConfigError, BadRecordError)):
            return Outcome(_first_line(e), EXIT_CONFIG)
        if isinstance(e, RunError):
            then = f"; then {resume}" if e.resumable else ""
            return Outcome(f"{_first_line(e)}{then}", EXIT_FAILED)

    full = disk_full(exc)
    if full is not None:
        target = getattr(full, "filename", None) or "the run's files"
        place = run_dir if run_dir is not None else Path(target if isinstance(target, str) else ".")
        return Outcome(
            f"no space left on device while writing {target} ({free_space(place)} on the file system "
            f"of {place}){where}; free some space there (or set run.output_dir elsewhere), then {resume}",
            EXIT_FAILED,
        )
    denied = not_writable(exc)
    if denied is not None:
        target = denied.filename or "the run's files"
        return Outcome(
            f"cannot write {target}: {denied.strerror or os.strerror(denied.errno)}{where}; make "
            f"{run_dir or 'run.output_dir'} writable again (or set run.output_dir elsewhere), then {resume}",
            EXIT_FAILED,
        )

    short = out_of_gpu_memory(exc)
    if short is not None:
        return Outcome(
            f"a GPU ran out of memory{where}{_where(exc)}: {short}; lower trainer.micro_batch_tokens or "
            f"rollout.engine.params.max_batch_size, set trainer.backend.params.gradient_checkpointing=true, "
            f"or, with the engine on the trainer's card, placement.release_engine_memory=true; then {resume}",
            EXIT_FAILED,
        )

    for e in causes(exc):
        if (
            type(e).__name__ in ("ActorDiedError", "RayActorError", "ActorUnavailableError")
            and type(e).__module__ == "ray.exceptions"
        ):
            text = str(e)
            klass = re.search(r"class_name: (\w+)", text)
            pid = re.search(r"\bpid: (\d+)", text)
            role = _ACTOR_ROLES.get(klass.group(1), klass.group(1)) if klass else "an"
            ident = f" (pid {pid.group(1)})" if pid else ""
            if getattr(e, "_actor_init_failed", False):  # its constructor raised: the last line says what
                last = [line.strip() for line in text.splitlines() if line.strip()][-1:] or ["(no message)"]
                return Outcome(
                    f"the {role} actor{ident} failed to start{where}: {last[0][:300]}; fix the cause, then {resume}",
                    EXIT_FAILED,
                )
            if "low on memory" in text:  # Ray's memory monitor
                why = "Ray killed it because the machine ran low on memory"
            elif "ray.kill" in text:
                why = "it was killed (ray.kill)"
            else:
                why = "its process exited unexpectedly (killed by a signal or the OOM killer, or crashed)"
            return Outcome(f"the {role} actor{ident} died{where}: {why}; {resume}", EXIT_FAILED)

    root = _root(exc)
    what = f"{type(root).__name__}: {_first_line(root)}" if _first_line(root) else type(root).__name__
    return Outcome(f"the run failed{where}: {what}{_where(exc)}; fix the cause, then {resume}", EXIT_FAILED)
