"""How a trainer's ranks split one replica of a model: Megatron's process groups, and the checks
that refuse a layout the ranks or the model cannot take, each in one line.

* ``tp`` tensor-parallel ranks hold a slice of every layer of a stage (sequence parallelism on);
* ``pp`` pipeline stages hold consecutive layers;
* ``ep`` expert-parallel ranks hold a block of every MoE layer's experts (they are data-parallel
  ranks for everything else);
* ``etp``: the ranks one expert is split over (Megatron's expert tensor parallelism): the tensor
  parallelism by default, or 1, each expert whole on its rank (a stage's ``tp`` ranks then hold
  different experts, as in Megatron's TP4 PP2 EP4 layouts on 8 cards);
* ``cp`` context-parallel ranks each hold a share of every sequence's tokens (the whole replica
  otherwise): see :mod:`loongsage.megatron.context`.

A stage's ranks are ``tp x cp`` for the dense layers and ``etp x ep`` for the experts, times their
data-parallel replicas: ``trainer.world_size / pp`` must be a multiple of both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loongsage.megatron.convert import Shape


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: tp
    cp: int = 1

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> Layout:
        """From the trainer's params (``tensor_parallel``, ``pipeline_parallel``, ``expert_parallel``,
        ``expert_tensor_parallel``), each an integer >= 1, or one line saying which is not."""
        names = {
            "tp": "tensor_parallel",
            "pp": "pipeline_parallel",
            "ep": "expert_parallel",
            "etp": "expert_tensor_parallel",
            "cp": "context_parallel",
        }
        sizes = {}
        for key, name in names.items():
            value = params.get(name, None if key == "etp" else 1)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"megatron trainer: {name}={value!r}; allowed: an integer >= 1")
            sizes[key] = value
        return cls(**sizes)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def split(self) -> bool:
        """Whether a replica spans several ranks (or its experts do)."""
        return max(self.tp, self.pp, self.ep, self.cp) > 1

    def check(self, config: Mapping, world_size: int) -> None:
        """One line naming what a size does not divide: the trainer's ranks, or the model's heads,
        key/value groups, feed-forward widths, experts or layers."""
        tp, pp, ep, etp, cp = self.tp, self.pp, self.ep, self.expert_tp, self.cp
        for name, size in (
            ("tensor_parallel", tp),
            ("expert_parallel", ep),
            ("pipeline_parallel", pp),
            ("context_parallel", cp),
        ):
            if world_size % size:
                raise ValueError(
                    f"{name}={size} does not divide trainer.world_size={world_size}; allowed: a divisor of {world_size}"
                )
        if etp not in (1, tp):
            raise ValueError(
                f"expert_tensor_parallel={etp}; allowed: 1 (each expert whole on its rank) or tensor_parallel={tp}"
            )
        if cp > 1 and ep > 1:
            raise ValueError(
                f"context_parallel={cp} with expert_parallel={ep} is not supported yet; allowed: "
                "expert_parallel=1 under context parallelism"
            )
        if world_size % (tp * pp * cp):
            split = f"tensor_parallel={tp} x pipeline_parallel={pp}" + (f" x context_parallel={cp}" if cp > 1 else "")
            raise ValueError(
                f"{split} does not divide trainer.world_size={world_size}; allowed: a product that "
                "divides it (the ranks of one replica)"
            )
        if world_size % (etp * ep * pp):
            experts = "tensor_parallel" if self.etp is None else "expert_tensor_parallel"
            raise ValueError(
                f"{experts}={etp} x expert_parallel={ep} x pipeline_parallel={pp} does not divide "
                f"trainer.world_size={world_size}; allowed: a product that divides it (the experts are "
                "split over these ranks in every stage)"
            )
        layers = int(config["num_hidden_layers"])
        if layers % pp:
            raise ValueError(
                f"pipeline_parallel={pp} does not divide num_hidden_layers={layers}; allowed: a divisor "
                f"of {layers} (equal stages)"
            )
        shape = Shape.of(config)
        shape.check_tp(tp)
        shape.check_ep(ep)
        for name, size in (("intermediate_size", tp), ("moe_intermediate_size", etp)):
            if config.get(name) and int(config[name]) % size:
                what = (
                    "tensor_parallel" if name == "intermediate_size" or self.etp is None else "expert_tensor_parallel"
                )
                raise ValueError(f"{what}={size} does not divide {name}={config[name]}; allowed: a divisor of it")

    def start(self, device: str) -> None:
        """Megatron's process groups over the run's trainer ranks (one process: a group of one of
        its own); CPU shims when CUDA is absent. A process runs one layout."""
        from loongsage.core.placement import free_port
        from loongsage.megatron.cpu import apply_cpu_shims
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        if not str(device).startswith("cuda"):
            apply_cpu_shims()
        if not dist.is_initialized():
            backend = "nccl" if str(device).startswith("cuda") else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        if ps.model_parallel_is_initialized():
            running = Layout(
                ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
                ps.get_expert_tensor_parallel_world_size(),
                ps.get_context_parallel_world_size(),
            )
            if (running.tp, running.pp, running.ep, running.expert_tp, running.cp) != (
                self.tp,
                self.pp,
                self.ep,
                self.expert_tp,
                self.cp,
            ):
                raise ValueError(f"megatron: this process runs {running}; a model asked for {self}")
            return
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.expert_tp,
            context_parallel_size=self.cp,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(int(torch.initial_seed()) % (2**31))
