"""Calibrate the calculator tool warm start: build it, then measure held-out greedy success and pass@k
through the real stack (the agentflow gateway on loopback over the embedded engine, the
``tool_agent`` with the official OpenAI client, the ``tool_calc`` reward).

    python bench/calibrate_tool_calc.py                       # the default warm start (cached)
    python bench/calibrate_tool_calc.py --set steps=600 lr=2e-3 --no-cache --out /tmp/ws

``--set`` overrides :class:`~loongsage.agentflow.tasks.warmstart.ToolCalcWarmStartParams` fields
(JSON values). Prints one JSON line: the params, the build's summary and the metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from loongsage.agentflow.tasks.tool_calc import ToolCalcReward
from loongsage.agentflow.tasks.warmstart import (
    ToolCalcWarmStartParams,
    build_tool_calc_warm_start,
    cached_tool_calc_warm_start,
)
from loongsage.core.tinytask.builds import INFO_FILE
from loongsage.core.types import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--set", nargs="+", action="extend", default=[], help="field=JSON overrides of the warm-start params"
    )
    parser.add_argument("--no-cache", action="store_true", help="build into --out instead of the cache")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", default=None, help="evaluate this folder, build nothing")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--pass-k", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()

    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    params = ToolCalcWarmStartParams(**overrides)
    start = time.perf_counter()
    if args.model:
        path = Path(args.model)
    elif args.no_cache:
        path = build_tool_calc_warm_start(args.out, params, log_every=args.log_every)
    else:
        path = cached_tool_calc_warm_start(params, log_every=args.log_every)
    built = time.perf_counter() - start
    info = json.loads((path / INFO_FILE).read_text())

    async def measure() -> dict[str, float]:
        records = [params.task("test", args.prompts)[i] for i in range(args.prompts)]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens)
        from loongsage.agentflow.agents.tool_agent import ToolAgent
        from loongsage.agentflow.gateway.local import evaluate, local_gateway

        async with local_gateway(str(path)) as gateway:
            return await evaluate(
                ToolAgent(tools=params.tools), ToolCalcReward(), records, gateway, sampling, pass_k=args.pass_k
            )

    t = time.perf_counter()
    metrics = asyncio.run(measure())
    print(
        json.dumps(
            {
                "model": str(path),
                "overrides": overrides,
                "final_loss": info.get("final_loss"),
                "sft_seconds": info.get("sft_seconds"),
                "build_seconds": info.get("build_seconds"),
                "wall_build": built,
                "eval_seconds": time.perf_counter() - t,
                **metrics,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
