"""Built-in algorithms, registered under the ``loongsage`` entry-point group.

Each hook maps a recipe name to a factory: a frozen dataclass whose fields are the entry's params,
made from the algorithm's pure function by :func:`loongsage.core.entries.entry` (which names it
after the same recipe name, for its own error messages).
"""

from __future__ import annotations

from loongsage.algos.advantages import GAE, GRPO, RLOO, ReinforcePP
from loongsage.algos.corrections import M2PO, OPSM, Decoupled, ImportanceSampling
from loongsage.algos.divergences import JSD, FullVocabKL, TopKJSD, TopKKL
from loongsage.algos.filters import DynamicSampling, OverlongFilter, RenamedLengthFilter, StatusFilter
from loongsage.algos.kl import K1, K2, K3, LowVarKL
from loongsage.algos.policy_losses import CISPO, GSPO, NLL, PPOClip
from loongsage.algos.rewards import ExactMatch, FormatReward, MathAnswer, OverlongShaping
from loongsage.core.hookspecs import Factories, hookimpl


@hookimpl
def loongsage_advantage_estimators() -> Factories:
    return {"grpo": GRPO, "rloo": RLOO, "reinforce_pp": ReinforcePP, "gae": GAE}


@hookimpl
def loongsage_policy_losses() -> Factories:
    return {"ppo_clip": PPOClip, "nll": NLL, "gspo": GSPO, "cispo": CISPO}


@hookimpl
def loongsage_kl_estimators() -> Factories:
    return {
        "k1": K1,
        "k2": K2,
        "k3": K3,
        "low_var_kl": LowVarKL,
        # distribution divergences of MOPD's GKD term (algorithm.distill.divergence)
        "topk_kl": TopKKL,
        "full_vocab_kl": FullVocabKL,
        "jsd": JSD,
        "topk_jsd": TopKJSD,
    }


@hookimpl
def loongsage_rewards() -> Factories:
    return {"exact_match": ExactMatch, "math": MathAnswer, "overlong_shaping": OverlongShaping, "format": FormatReward}


@hookimpl
def loongsage_corrections() -> Factories:
    return {"is": ImportanceSampling, "decoupled": Decoupled, "m2po": M2PO, "opsm": OPSM}


@hookimpl
def loongsage_data_filters() -> Factories:
    return {
        "dynamic_sampling": DynamicSampling,
        "status": StatusFilter,
        "overlong": OverlongFilter,
        "length": RenamedLengthFilter,
    }  # the old name answers with one line pointing to overlong
