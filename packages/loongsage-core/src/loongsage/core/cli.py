"""The ``loongsage`` launcher.

    loongsage train <recipe> [key=value ...] [--config-dir DIR]
    loongsage plugins [--verbose]
    loongsage recipes [--config-dir DIR]
    loongsage report <run_dir>
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
from pathlib import Path
from typing import Iterator

from loongsage.core.types import BadRecordError, ConfigError

log = logging.getLogger("loongsage")
COMMANDS = ("train", "plugins", "recipes", "report")


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


def _setup_logging(log_dir: str) -> Path:
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    path = Path(log_dir) / f"trainer_{time.strftime('%Y%m%d_%H%M%S')}.log"
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("[loongsage] %(message)s"))
    root = logging.getLogger("loongsage")
    for handler in root.handlers:  # an earlier run's log file, in this process
        handler.close()
    root.handlers[:] = [file_handler, console]
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
    watchdog = subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid())], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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
    from loongsage.core.config import load_config
    from loongsage.core.controller import Controller

    if args.recipe is None:
        raise ConfigError("train: no recipe given; usage: loongsage train <recipe> [key=value ...], e.g. "
                          "loongsage train tiny/grpo_arith_cpu; `loongsage recipes` lists the recipes")
    if "=" in args.recipe and not Path(args.recipe).is_file():
        raise ConfigError(f"train: the recipe comes first, got the override {args.recipe!r}; usage: loongsage train "
                          "<recipe> [key=value ...]; `loongsage recipes` lists the recipes")
    cfg, registry = load_config(args.recipe, args.overrides, config_dir=args.config_dir)
    run_dir = cfg.run_dir
    for key, path in (("run.output_dir", run_dir), ("run.log_dir", Path(cfg.run.log_dir))):
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{key}: cannot create the directory {str(path)!r}: {exc.strerror or exc}") from None
    log_path = _setup_logging(cfg.run.log_dir)
    from omegaconf import OmegaConf

    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
    log.info("recipe %s -> %s (log %s)", args.recipe, run_dir, log_path)
    with reap_on_abnormal_exit():
        summary = Controller(cfg, registry).run()
    last = summary["last_metrics"]
    evals = " ".join(f"{k}={v:.3f}" for k, v in sorted(last.items()) if k.startswith("eval/"))
    print(f"done: {summary['steps']} steps, engine version {summary['version']}, outputs in {run_dir} {evals}")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from loongsage.core.plugins import BACKEND_KINDS, CATEGORIES, load_registry
    from loongsage.core.schema import describe_params

    registry = load_registry(args.plugin or [])
    rows = []
    for category in (*CATEGORIES, *BACKEND_KINDS):
        hook = CATEGORIES.get(category, "loongsage_backends")
        label = category if category in CATEGORIES else f"backend:{category}"
        entries = [registry.tables[category][n] for n in registry.names(category)]
        if not entries:
            rows.append((hook, label, "-", ""))
        for e in entries:
            rows.append((hook, label, e.name, e.provider))
            if args.verbose:
                rows.append(("", "", "", "  params: " + (describe_params(e.factory) or "(none)")))
    widths = [max(len(r[i]) for r in rows + [("hook", "extension point", "name", "provider")]) for i in range(3)]
    header = ("hook", "extension point", "name", "provider")
    for row in [header, tuple("-" * w for w in widths) + ("-" * 8,), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[3])
    return 0


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
        raise ConfigError(f"report: no metrics.jsonl in {args.run_dir!r}; pass a run's output directory "
                          "(e.g. runs/grpo_arith_cpu)")
    from loongsage.core.report import write_report

    try:
        paths = write_report(run_dir)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(f"report: {run_dir / 'metrics.jsonl'} is not a run's metrics (one JSON object with a "
                          f"'step' per line): {type(exc).__name__}: {exc}") from None
    for path in paths:
        print(path)
    return 0


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
    r = sub.add_parser("recipes", help="list the recipes the launcher can find")
    r.add_argument("--config-dir", default=None)
    r.set_defaults(func=cmd_recipes)
    rep = sub.add_parser("report", help="write PNG plots of a run's metrics")
    rep.add_argument("run_dir")
    rep.set_defaults(func=cmd_report)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; overrides may come before or after ``--config-dir``."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    if args.command is None:
        raise UsageError(f"no command given; choose one of: {', '.join(COMMANDS)} (see `loongsage --help`)")
    if args.command == "train":
        args.overrides = [*args.overrides, *(a for a in extra if not a.startswith("-"))]
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        raise UsageError(f"{args.command}: unrecognized arguments: {' '.join(extra)} "
                         f"(see `loongsage {args.command} --help`)")
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
