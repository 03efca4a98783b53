"""GPU placement on a real Ray that declares GPUs (this machine has none; Ray schedules the GPU
resource all the same and sets each actor's ``CUDA_VISIBLE_DEVICES``): colocated, trainer rank i,
engine i and the roles riding along share bundle i's card; disaggregated, every role has a card of
its own. Run in a subprocess: it needs a Ray of its own with GPUs declared."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

PROBE = r"""
import json, os
import ray
from ray.util.placement_group import remove_placement_group
from loongsage.core.config import load_config
from loongsage.core.placement import Placement

ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)

@ray.remote
class Probe:
    def devices(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES")

out = {}
for name, overrides, riders in (
        ("colocated", ["trainer.world_size=2", "rollout.num_engines=2", "placement.gpus_per_actor=1"], [0]),
        ("disaggregated", ["colocate=false", "rollout.num_engines=2", "placement.gpus_per_actor=1"], [])):
    cfg, _ = load_config("tiny/grpo_arith_cpu", overrides)
    place = Placement(cfg, riders)
    slots = {"trainer": [place.slot(b, ()) for b in place.trainer_bundles],
             "engine": [place.slot(b, ()) for b in place.engine_bundles],
             "rider": [place.slot(b, (), num_cpus=0) for b in riders]}
    actors = {role: [Probe.options(**s.options).remote() for s in ss] for role, ss in slots.items()}
    out[name] = {role: ray.get([a.devices.remote() for a in ss]) for role, ss in actors.items()}
    out[name]["num_gpus"] = {role: [s.options.get("num_gpus") for s in ss] for role, ss in slots.items()}
    for ss in actors.values():
        for a in ss:
            ray.kill(a)
    remove_placement_group(place.pg)
print("RESULT", json.dumps(out))
"""


def test_each_role_sees_its_bundles_gpu():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-2000:]
    out = json.loads(line.removeprefix("RESULT "))
    colocated = out["colocated"]
    # bundle 0 holds trainer 0, engine 0 and the rider (a third of its GPU each); bundle 1 trainer 1, engine 1
    assert colocated["num_gpus"] == {"trainer": [1 / 3, 0.5], "engine": [1 / 3, 0.5], "rider": [1 / 3]}
    t, e, r = colocated["trainer"], colocated["engine"], colocated["rider"]
    assert t[0] == e[0] == r[0] and t[1] == e[1] and t[0] != t[1], colocated
    assert all(d is not None and len(d.split(",")) == 1 for d in (*t, *e)), colocated  # one card each
    apart = out["disaggregated"]
    assert apart["num_gpus"] == {"trainer": [1.0], "engine": [1.0, 1.0], "rider": []}
    cards = [*apart["trainer"], *apart["engine"]]
    assert len(set(cards)) == 3 and all(c is not None for c in cards), apart
