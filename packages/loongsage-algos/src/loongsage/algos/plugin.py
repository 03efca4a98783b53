"""Built-in algorithms, registered under the ``loongsage`` entry-point group.

Each hook maps a recipe name to a factory: a frozen dataclass whose fields are the entry's params.
"""

from __future__ import annotations

from loongsage.algos.advantages import GRPO
from loongsage.algos.kl import K1, K2, K3, LowVarKL
from loongsage.algos.policy_losses import NLL, PPOClip
from loongsage.algos.rewards import ExactMatch
from loongsage.core.hookspecs import Factories, hookimpl


@hookimpl
def loongsage_advantage_estimators() -> Factories:
    return {"grpo": GRPO}


@hookimpl
def loongsage_policy_losses() -> Factories:
    return {"ppo_clip": PPOClip, "nll": NLL}


@hookimpl
def loongsage_kl_estimators() -> Factories:
    return {"k1": K1, "k2": K2, "k3": K3, "low_var_kl": LowVarKL}


@hookimpl
def loongsage_rewards() -> Factories:
    return {"exact_match": ExactMatch}
