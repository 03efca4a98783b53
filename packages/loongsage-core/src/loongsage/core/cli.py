"""The ``loongsage`` launcher.

loongsage train <recipe> [key=value ...] [--config-dir DIR]
loongsage plugins [--verbose]
loongsage reference [--out PATH]
loongsage recipes [--config-dir DIR]
loongsage report <run_dir>
loongsage serve <recipe | HF model folder> [key=value ...] [--port N] [--host H] [--record DIR]
loongsage plan <recipe> [key=value ...] [--gpus N] [--gpu h200|h100|a100] [--lengths MEDIAN,P99]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from loongsage.core.failures import Stopped, explain, install_stop_handlers, restore_previous_handlers
from loongsage.core.types import BadRecordError, ConfigError

log = logging.getLogger("loongsage")
COMMANDS = ("train", "plugins", "reference", "recipes", "report", "serve", "doctor", "plan")


class UsageError(Exception):
    """A malformed command line; reported like a config error, as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one ``loongsage: error:`` line (no usage block) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        command = self.prog.removeprefix("loongsage").strip()
        bad = re.search(r"invalid choice: '(.*?)'", message)
        if not command and bad:
            message = f"unknown command {bad.group(1)!r}; choose one of: {', '.join(COMMANDS)}"
        raise UsageError(f"{command + ': ' if command else ''}{message} (see `{self.prog} --help`)")


class _LogFile(logging.FileHandler):
    """A log file that goes quiet when it cannot be written (a full disk): logging's default prints
    a traceback per record to stderr, which would bury the one line that says what happened."""

    failed = False

    def __init__(self, path: Path):
        super().__init__(path)
        self.shown = str(path)  # as the user gave it (relative stays relative), for messages

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        self.failed = True


def _log_to_files(message: str, exc: BaseException) -> str | None:
    """``message`` and ``exc``'s traceback to the launcher's log files only (never the terminal, nor
    logging's last-resort stderr when no file could be opened); the first file that took it, if any."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), (type(exc), exc, exc.__traceback__))
    kept = None
    for handler in reversed(log.handlers):  # the run's own log first
        if isinstance(handler, _LogFile) and not handler.failed:
            handler.handle(record)
            if not handler.failed and kept is None:
                kept = handler.shown
    return kept


class _ConsoleFilter(logging.Filter):
    """Keeps off the terminal what only the log files get: per-step metric lines, tracebacks, the
    actors' output (records logged with ``extra={"file_only": True}``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)


def _setup_logging(log_dir: str, run_log: Path | None = None) -> Path:
    """The launcher's log ``<log_dir>/trainer_<timestamp>.log`` and, for a run, ``run_log`` (appended
    to, so a resumed run continues its log); the terminal gets the plain messages."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    path = Path(log_dir) / f"trainer_{time.strftime('%Y%m%d_%H%M%S')}.log"
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    files = [_LogFile(path)] + ([_LogFile(run_log)] if run_log is not None else [])
    for handler in files:
        handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("[loongsage] %(message)s"))
    console.addFilter(_ConsoleFilter())
    root = logging.getLogger("loongsage")
    for handler in root.handlers:  # an earlier run's log file, in this process
        handler.close()
    root.handlers[:] = [*files, console]
    root.setLevel(logging.INFO)
    root.propagate = False
    for name in ("loongsage.core.data",):
        logging.getLogger(name).setLevel(logging.INFO)
    return path


# The watchdog of a training launcher (see reap_on_abnormal_exit), a program of its own: it must outlive
# the launcher. argv[1] is the launcher's pid. It records the launcher's descendants (pid, start
# time) every half second; when the launcher is gone (its pipe closes, or its pid does) without
# having written the stand-down byte, it kills those still running (SIGKILL).
_WATCHDOG = r"""
import os, select, signal, sys

root, me = int(sys.argv[1]), os.getpid()

def processes():
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(name)] = (int(fields[1]), fields[19])  # parent pid, start time
    return table

def descendants(table):
    children = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid != me and pid not in found:
                found[pid] = table[pid][1]
                todo.append(pid)
    return found

table = processes()
root_start = table.get(root, (0, None))[1]
seen = {}
while True:
    ready = select.select([0], [], [], 0.5)[0]
    if ready and os.read(0, 1):
        sys.exit(0)  # the launcher cleaned up after itself
    table = processes()
    if ready or table.get(root, (0, None))[1] != root_start:
        break  # the launcher is gone
    seen = {pid: start for pid, start in seen.items() if table.get(pid, (0, None))[1] == start}
    seen.update(descendants(table))
table = processes()
for pid, start in seen.items():
    if table.get(pid, (0, None))[1] == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


@contextlib.contextmanager
def reap_on_abnormal_exit() -> Iterator[None]:
    """Kill what this process started if it dies without cleaning up (kill -9, an OOM kill).

    Ray's head processes share the launcher's fate, and its workers follow the raylet, but the
    agents the raylet starts outlive a killed launcher by about a minute (they first try to report
    to the GCS that died with it). A watchdog process records this process's descendants while it
    runs and, if it dies, kills the ones left. Leaving the block (normally or by an exception, once
    the controller has released Ray) stands the watchdog down. Linux only (it reads /proc).
    """
    if not sys.platform.startswith("linux"):
        yield
        return
    watchdog = subprocess.Popen(
        [sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        try:
            watchdog.stdin.write(b"x")
            watchdog.stdin.close()
            watchdog.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            watchdog.kill()


def cmd_train(args: argparse.Namespace) -> int:
    from loongsage.core.checkpoint import check_resumable
    from loongsage.core.config import load_config
    from loongsage.core.controller import Controller
    from loongsage.core.validation import check_machine

    if args.recipe is None:
        raise ConfigError(
            "train: no recipe given; usage: loongsage train <recipe> [key=value ...], e.g. "
            "loongsage train tiny/grpo_arith_cpu; `loongsage recipes` lists the recipes"
        )
    if "=" in args.recipe and not Path(args.recipe).is_file():
        raise ConfigError(
            f"train: the recipe comes first, got the override {args.recipe!r}; usage: loongsage train "
            "<recipe> [key=value ...]; `loongsage recipes` lists the recipes"
        )
    cfg, registry = load_config(args.recipe, args.overrides, config_dir=args.config_dir)
    run_dir = cfg.run_dir
    if not ("ray" in sys.modules and sys.modules["ray"].is_initialized()):  # this run starts Ray on this machine
        check_machine(cfg)
    if cfg.checkpoint.resume:
        check_resumable(run_dir, [s.name for s in cfg.data_sources], cfg.run.total_steps)
    else:
        _refuse_previous_run(run_dir, cfg.run.name, cfg.run.total_steps)
    folders = [("run.output_dir", run_dir), ("run.log_dir", Path(cfg.run.log_dir))]
    if cfg.run.profile_steps:  # found now, not by the actors at the first profiled step
        from loongsage.core.profiling import trace_dir

        folders.append(("run.profile_dir", trace_dir(cfg)))
    for key, path in folders:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{key}: cannot create the directory {str(path)!r}: {exc.strerror or exc}") from None
    run_log = run_dir / "run.log"
    controller = None
    try:
        log_path = _setup_logging(cfg.run.log_dir, run_log=run_log)
        from omegaconf import OmegaConf

        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
        log.info("recipe %s -> %s (log %s)", args.recipe, run_dir, run_log)
        log.info("launcher log: %s", log_path, extra={"file_only": True})
        controller = Controller(cfg, registry)
        install_stop_handlers()
        with reap_on_abnormal_exit():
            summary = controller.run()
    except (Exception, KeyboardInterrupt, Stopped) as exc:
        training = controller is not None and controller.training
        outcome = explain(
            exc, run_dir=run_dir, step=controller.step if training else None, total_steps=cfg.run.total_steps
        )
        # the traceback goes to the log files only; the terminal gets the one line, naming a log
        # that took it (not run.log on a full disk)
        kept = _log_to_files("run stopped: " + outcome.message, exc)
        traceback = (
            f"; the traceback is in {kept}" if kept and not isinstance(exc, (KeyboardInterrupt, Stopped)) else ""
        )
        print(f"loongsage: error: {outcome.message}{traceback}", file=sys.stderr)
        return outcome.code
    finally:
        restore_previous_handlers()
    last = summary["last_metrics"]
    evals = " ".join(f"{k}={v:.3f}" for k, v in sorted(last.items()) if k.startswith("eval/"))
    print(f"done: {summary['steps']} steps, engine version {summary['version']}, outputs in {run_dir} {evals}")
    return 0


def _refuse_previous_run(run_dir: Path, name: str, total_steps: int) -> None:
    """A run does not write into another's folder: its metrics, event files and config would mix
    with the earlier run's, and the report would show both as one. A folder holds a run once a
    step's metrics, a checkpoint or the final model is there (a run that failed before logging
    anything left nothing to mix with)."""
    metrics = run_dir / "metrics.jsonl"
    if not (
        (metrics.is_file() and metrics.stat().st_size > 0)
        or (run_dir / "checkpoints").is_dir()
        or (run_dir / "final").exists()
    ):
        return
    from loongsage.core.checkpoint import latest

    checkpoint = latest(run_dir)
    if (run_dir / "final").exists() or (checkpoint is not None and checkpoint.name == f"step_{total_steps:06d}"):
        what, resume = "a finished run", "train it further with resume=true and a larger run.total_steps"
    elif checkpoint is not None:
        what, resume = f"a run stopped after its checkpoint {checkpoint.name}", "continue it with resume=true"
    else:
        what, resume = "a run that stopped before its first checkpoint", "start it again there with resume=true"
    raise ConfigError(
        f"run.name={name}: {run_dir} already holds {what}; {resume}, give this run its own folder "
        "(another run.name=... or run.output_dir=...), or remove that folder"
    )


def cmd_plugins(args: argparse.Namespace) -> int:
    from loongsage.core.contracts import BACKENDS
    from loongsage.core.hookspecs import BACKEND, HOOKS
    from loongsage.core.plugins import load_registry
    from loongsage.core.schema import describe_params

    registry = load_registry(args.plugin or [])
    rows = []
    for hook in HOOKS.values():  # a backend's table is its kind's, listed as backend:<kind>
        tables = (
            [(f"{BACKEND}:{kind}", kind) for kind in BACKENDS]
            if hook.category == BACKEND
            else [(hook.category, hook.category)]
        )
        for label, category in tables:
            entries = [registry.tables[category][n] for n in registry.names(category)]
            if not entries:
                rows.append((hook.name, label, "-", ""))
            for e in entries:
                rows.append((hook.name, label, e.name, e.provider))
                if args.verbose:
                    rows.append(("", "", "", "  params: " + (describe_params(e.factory) or "(none)")))
    widths = [max(len(r[i]) for r in rows + [("hook", "extension point", "name", "provider")]) for i in range(3)]
    header = ("hook", "extension point", "name", "provider")
    for row in [header, tuple("-" * w for w in widths) + ("-" * 8,), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[3])
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    from loongsage.core.plugins import load_registry
    from loongsage.core.reference import config_reference

    out = Path(args.out) if args.out else None
    if out is not None and out.is_dir():
        raise ConfigError(
            f"reference: --out {args.out!r} is a directory; pass the file to write, e.g. docs/reference/config.md"
        )
    if out is not None and not out.parent.is_dir():  # checked before the plugins load: a typo fails at once
        raise ConfigError(
            f"reference: --out {args.out!r}: no folder {str(out.parent)!r}; create it or pass another path"
        )
    text = config_reference(load_registry())
    if out is None:
        print(text, end="")
    else:
        try:
            out.write_text(text)
        except OSError as exc:  # a read-only folder, a full disk
            raise ConfigError(f"reference: cannot write {args.out!r}: {exc.strerror or exc}") from None
        print(out)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from loongsage.core.doctor import CAPABILITIES, report
    from loongsage.core.plugins import load_registry

    asked = {name for name in ("gpu", *CAPABILITIES) if getattr(args, name)}
    return report(asked, load_registry(args.plugin or []))


def cmd_recipes(args: argparse.Namespace) -> int:
    from loongsage.core.config import list_recipes

    for name in list_recipes(args.config_dir):
        print(name)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    import json

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "no such directory"
        raise ConfigError(f"report: {args.run_dir!r}: {what}; pass a run's output directory (e.g. runs/grpo_arith_cpu)")
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(
            f"report: no metrics.jsonl in {args.run_dir!r}; pass a run's output directory (e.g. runs/grpo_arith_cpu)"
        )
    from loongsage.core.report import write_report

    try:
        paths = write_report(run_dir)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"report: {run_dir / 'metrics.jsonl'} is not a run's metrics (one JSON object with a "
            f"'step' per line): {type(exc).__name__}: {exc}"
        ) from None
    for path in paths:
        print(path)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # the serving itself lives in loongsage.core.serving; the gateway comes from a plugin, by name
    from loongsage.core.serving import load_serve_config, prepare, serve

    cfg, registry = load_serve_config(args.target, args.overrides, config_dir=args.config_dir)
    record_dir = prepare(cfg, args.record, args.port, args.host)
    log.info("serve %s, recording to %s (log %s)", args.target, record_dir, _setup_logging(cfg.run.log_dir))
    with reap_on_abnormal_exit():
        print(f"loongsage serve: {serve(cfg, registry, record_dir=record_dir, port=args.port, host=args.host)}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    # the throughput model and its answer live in loongsage.core.throughput
    from loongsage.core.throughput.command import run

    return run(args)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="loongsage", description="LoongSage: RL post-training for LLMs")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    t = sub.add_parser("train", help="run a recipe: loongsage train tiny/grpo_arith_cpu [key=value ...]")
    t.add_argument("recipe", nargs="?", help="recipe name (e.g. tiny/grpo_arith_cpu) or path to a YAML file")
    t.add_argument("overrides", nargs="*", default=[], help="Hydra overrides, e.g. run.total_steps=5 colocate=false")
    t.add_argument("--config-dir", default=None, help="extra directory searched first for recipes")
    t.set_defaults(func=cmd_train)
    pl = sub.add_parser("plugins", help="table of every extension point and its providers")
    pl.add_argument("--verbose", "-v", action="store_true", help="also list each entry's parameters")
    pl.add_argument("--plugin", action="append", help="also load this module (as plugins: in a config)")
    pl.set_defaults(func=cmd_plugins)
    rf = sub.add_parser("reference", help="the config reference as markdown: every key, every plugin entry's params")
    rf.add_argument("--out", default=None, metavar="PATH", help="write it to this file (default: print it)")
    rf.set_defaults(func=cmd_reference)
    dr = sub.add_parser("doctor", help="check what runs on this machine need; each missing piece with its fix")
    dr.add_argument("--gpu", action="store_true", help="require CUDA, the driver, GPUs (torch and Ray) and NCCL")
    dr.add_argument("--sglang", action="store_true", help="require the sglang engine and SGLang")
    dr.add_argument("--megatron", action="store_true", help="require the megatron trainer and Megatron-Core")
    dr.add_argument("--sandbox", action="store_true", help="require the local sandbox (bubblewrap)")
    dr.add_argument("--plugin", action="append", help="also load this module (as plugins: in a config)")
    dr.set_defaults(func=cmd_doctor)
    r = sub.add_parser("recipes", help="list the recipes the launcher can find")
    r.add_argument("--config-dir", default=None)
    r.set_defaults(func=cmd_recipes)
    rep = sub.add_parser("report", help="write PNG plots of a run's metrics")
    rep.add_argument("run_dir")
    rep.set_defaults(func=cmd_report)
    sv = sub.add_parser("serve", help="serve a recipe's policy (or an HF model folder) to agents, recording sessions")
    sv.add_argument("target", nargs="?", help="recipe name or YAML file, or an HF model folder")
    sv.add_argument("overrides", nargs="*", default=[], help="Hydra overrides, e.g. rollout.num_engines=2")
    sv.add_argument("--port", type=int, default=0, help="the gateway's port (default: a free one)")
    sv.add_argument("--host", default=None, help="the address to listen on (default: the gateway's, 127.0.0.1)")
    sv.add_argument("--record", default=None, help="where sessions are recorded (default: runs/<name>/served)")
    sv.add_argument("--config-dir", default=None, help="extra directory searched first for recipes")
    sv.set_defaults(func=cmd_serve)
    from loongsage.core.throughput.command import add_arguments

    pn = sub.add_parser("plan", help="predicted step time, phases, GPU use and placement of a recipe (no GPU needed)")
    add_arguments(pn)
    pn.set_defaults(func=cmd_plan)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; overrides may come before or after ``--config-dir``."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    if args.command is None:
        raise UsageError(f"no command given; choose one of: {', '.join(COMMANDS)} (see `loongsage --help`)")
    if args.command in ("train", "serve", "plan"):
        args.overrides = [*args.overrides, *(a for a in extra if not a.startswith("-"))]
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        raise UsageError(
            f"{args.command}: unrecognized arguments: {' '.join(extra)} (see `loongsage {args.command} --help`)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        return args.func(args)
    except (ConfigError, BadRecordError, FileNotFoundError, UsageError) as exc:
        print(f"loongsage: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
