"""The ``loongsage`` launcher.

    loongsage train <recipe> [key=value ...] [--config-dir DIR]
    loongsage plugins [--verbose]
    loongsage recipes [--config-dir DIR]
    loongsage report <run_dir>
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from loongsage.core.types import BadRecordError, ConfigError

log = logging.getLogger("loongsage")


def _setup_logging(log_dir: str) -> Path:
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    path = Path(log_dir) / f"trainer_{time.strftime('%Y%m%d_%H%M%S')}.log"
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("[loongsage] %(message)s"))
    root = logging.getLogger("loongsage")
    root.handlers[:] = [file_handler, console]
    root.setLevel(logging.INFO)
    root.propagate = False
    for name in ("loongsage.core.data",):
        logging.getLogger(name).setLevel(logging.INFO)
    return path


def cmd_train(args: argparse.Namespace) -> int:
    from loongsage.core.config import load_config
    from loongsage.core.controller import Controller

    cfg, registry = load_config(args.recipe, args.overrides, config_dir=args.config_dir)
    log_path = _setup_logging(cfg.run.log_dir)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    from omegaconf import OmegaConf

    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
    log.info("recipe %s -> %s (log %s)", args.recipe, run_dir, log_path)
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
    from loongsage.core.report import write_report

    for path in write_report(args.run_dir):
        print(path)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loongsage", description="LoongSage: RL post-training for LLMs")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a recipe: loongsage train tiny/grpo_arith_cpu [key=value ...]")
    t.add_argument("recipe", help="recipe name (e.g. tiny/grpo_arith_cpu) or path to a YAML file")
    t.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. run.total_steps=5 colocate=false")
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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, BadRecordError, FileNotFoundError) as exc:
        print(f"loongsage: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
