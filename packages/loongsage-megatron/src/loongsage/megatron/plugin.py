"""The Megatron-Core trainer, registered under the ``loongsage`` entry-point group."""

from __future__ import annotations

from loongsage.core.hookspecs import Factories, hookimpl
from loongsage.megatron.trainer import MegatronTrainer


@hookimpl
def loongsage_backends() -> Factories:
    return {"megatron": MegatronTrainer}  # one Megatron-Core GPT model per data-parallel rank
