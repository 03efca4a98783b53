"""What the core itself registers: the embedded default backends (trainer, critic, engine, teacher,
transport, model builder), the single-turn and sft agents, the sync scheduler, the file reader and
the tiny arithmetic and digit-sorting tasks (with the sorting task's reward), the speed workloads
(random-weight models of real shapes, fixed-length prompts), the trackers."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from loongsage.core.data import FileReader
from loongsage.core.engine.native import NativeEngine
from loongsage.core.hookspecs import Factories, hookimpl
from loongsage.core.rollout import SingleTurnAgent
from loongsage.core.rollout.schedulers import SCHEDULERS
from loongsage.core.sft import ConstantReward, SFTAgent
from loongsage.core.tinytask.arith import ArithmeticTask
from loongsage.core.tinytask.digit_sort import DigitSortReward, DigitSortTask
from loongsage.core.tinytask.shapes import RandomDigits, RandomInitModel
from loongsage.core.tinytask.warmstart import WarmStartParams, cached_warm_start
from loongsage.core.tracking import JsonlTracker, TensorboardTracker, WandbTracker
from loongsage.core.trainer.critic import TorchCritic
from loongsage.core.trainer.teacher import EmbeddedTeacher
from loongsage.core.trainer.torch_trainer import TorchTrainer
from loongsage.core.transport import CpuTransport


@dataclass
class TinyArithModel(WarmStartParams):
    """Model builder: the tiny Qwen3 and tokenizer with an SFT warm start, cached by its params.

    With ``init_from`` it fine-tunes another cached warm start instead (how the MOPD teachers of
    tiny/mopd_two_teachers_cpu are made: correct answers of one operation). With ``sort`` the same
    model also learns the digit-sorting task (tiny/mixed_async_cpu's two-task warm start).
    """

    kind = "model_builder"

    def build(self) -> Path:
        return cached_warm_start(WarmStartParams(**asdict(self)))


@hookimpl
def loongsage_agents() -> Factories:
    return {"single_turn": SingleTurnAgent, "sft": SFTAgent}


@hookimpl
def loongsage_rewards() -> Factories:
    return {"constant": ConstantReward, "digit_sort": DigitSortReward}


@hookimpl
def loongsage_data_sources() -> Factories:
    return {"file": FileReader, "arith": ArithmeticTask, "digit_sort": DigitSortTask, "random_digits": RandomDigits}


@hookimpl
def loongsage_rollout_schedulers() -> Factories:
    return dict(SCHEDULERS)


@hookimpl
def loongsage_backends() -> Factories:
    return {
        "torch": TorchTrainer,
        "torch_critic": TorchCritic,
        "native": NativeEngine,
        "embedded": EmbeddedTeacher,
        "cpu": CpuTransport,
        "jsonl": JsonlTracker,
        "tensorboard": TensorboardTracker,
        "wandb": WandbTracker,
        "tiny_arith": TinyArithModel,
        "random_init": RandomInitModel,
    }
