"""The trainer skeleton and its model-adapter contract: the torch backend implements every member of
the adapter, and neither the torch trainer nor the critic overrides the skeleton's step mechanics
(their own ``__post_init__`` builds the adapter; the critic writes its state its own way)."""

from __future__ import annotations

import pytest

from loongsage.core import contract_check
from loongsage.core.tinytask.tiny_model import build_tiny_qwen3
from loongsage.core.trainer.adapter import ModelAdapter
from loongsage.core.trainer.critic import TorchCritic
from loongsage.core.trainer.skeleton import TrainerSkeleton
from loongsage.core.trainer.torch_trainer import TorchTrainer


def skeleton_overrides(cls: type) -> list[str]:
    """The skeleton's methods and properties that ``cls`` or a class between it and the skeleton defines again."""
    own = {
        name
        for name, value in vars(TrainerSkeleton).items()
        if not name.startswith("__") and (callable(value) or isinstance(value, (property, classmethod)))
    }
    between = cls.__mro__[: cls.__mro__.index(TrainerSkeleton)]
    return sorted({name for klass in between for name in vars(klass) if name in own})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_qwen3(path, hidden_size=32, num_layers=1, heads=2, kv_heads=1, intermediate_size=64, seed=3)
    return str(path)


def test_the_torch_trainers_override_nothing_of_the_skeleton():
    assert skeleton_overrides(TorchTrainer) == []
    assert skeleton_overrides(TorchCritic) == ["export_hf"]  # the value model's state as critic.pt


@pytest.mark.parametrize("trainer", [TorchTrainer, TorchCritic])
def test_the_torch_adapters_implement_every_member_of_the_contract(model_dir, trainer):
    adapter = trainer(model_dir).adapter
    missing = [m.name for m in contract_check.members(ModelAdapter) if not hasattr(adapter, m.name)]
    assert not missing
    members = {m.name: m for m in contract_check.members(ModelAdapter)}
    assert {name for name, m in members.items() if m.role == "method"} >= {
        "sequence_logprobs",
        "sequence_distribution",
        "run_micro_batches",
        "clip_grad_norm",
        "write_hf",
    }
    assert adapter.sharded is False and adapter.vocab_split is None and adapter.optimizer_file is None
    assert adapter.reference is None  # no LoRA: the reference is a model of its own
