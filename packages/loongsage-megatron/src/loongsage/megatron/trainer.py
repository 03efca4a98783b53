"""``megatron``: the trainer backend on a Megatron-Core GPT model (the trainer contract).

The model is built from the HF checkpoint (:mod:`.model`: the TE-free layer with torch's fused
attention) and its weights converted in (:mod:`.convert`). Everything around the model is the torch
trainer's: micro-batches by token budget, segments scored alone, the loss functions, AdamW with
warm-up and clipping, replicated data parallelism (gradients summed over gloo or NCCL), checkpoints
of HF-named tensors (so a checkpoint moves between the two backends), exports to the engines and to
an HF folder. What differs is the forward: Megatron's ``[batch, seq]`` interface with explicit
positions and a boolean mask, and the conversion at every boundary.

A replica may be split over ranks (:mod:`.parallel`): ``tensor_parallel`` ranks each hold a slice
of every layer and see the same rows; under ``expert_parallel`` each rank holds a block of every
MoE layer's experts and trains on rows of its own (the experts' ranks are data-parallel ranks for
everything else). ``distributed_optimizer`` splits the float32 masters and AdamW state over the
data-parallel ranks, the experts' over the ranks holding them. Pipeline parallelism is not wired
yet (docs/megatron.md).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from loongsage.core.embedded.logprobs import response_start
from loongsage.core.embedded.trainer import _DTYPES, TorchTrainer, sum_in_place
from loongsage.core.segments import segment_layout
from loongsage.core.types import TrainBatch
from loongsage.megatron.convert import Shape, mcore_to_hf, merge_expert_shards
from loongsage.megatron.model import (architecture, build_gpt, check_attention, clear_routes, gpt_logits, load_hf_weights,
                                      rope_base)
from loongsage.megatron.parallel import (clip_grad_norm, gathered_state, parameter_kinds, sum_replicated_grads,
                                        vocab_parallel_logprobs)


def read_config(model_path: str) -> dict[str, Any]:
    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"megatron trainer: cannot read {model_path}/config.json ({exc})") from None


@dataclass
class MegatronTrainer(TorchTrainer):
    """Megatron-Core GPT model, one replica per data-parallel rank (see the module docstring)."""

    kind = "trainer"

    dp_mode: Literal["replicate"] = "replicate"
    attention: str = "sdpa"  # torch's fused kernels; "local": Megatron's unfused attention
    routing_replay: bool = True  # R3 on an MoE model: replay the engine's routed experts when rows carry them
    tensor_parallel: int = 1  # ranks one replica is split over (trainer.world_size: a multiple of it)
    expert_parallel: int = 1  # ranks an MoE layer's experts are split over (each trains on rows of its own)
    supports_lora: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_attention(self.attention)  # before Megatron's process groups start
        for name in ("tensor_parallel", "expert_parallel"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"megatron trainer: {name}={value!r}; allowed: an integer >= 1")
        self._routes: Tensor | None = None  # the routes of the micro-batch in the forward (R3)
        self._replayed_tokens = 0
        if self.dp_mode != "replicate":
            raise ValueError(f"megatron trainer: dp_mode={self.dp_mode!r}; allowed: replicate")
        super().__post_init__()

    @classmethod
    def preflight(cls, params: dict[str, Any], model_path: str, *, world_size: int = 1) -> None:
        """The architecture and the parameters, checked in the driver before any actor starts."""
        if params.get("lora") is not None:
            raise ValueError("lora: MegatronTrainer does not support LoRA; leave lora unset")
        check_attention(params.get("attention", "sdpa"))
        config = read_config(model_path)
        architecture(config)
        rope_base(config)
        check_layout(config, int(params.get("tensor_parallel", 1)), world_size, int(params.get("expert_parallel", 1)))

    def _load_model(self) -> torch.nn.Module:
        self.config = read_config(self.model_path)
        self.shape = Shape.of(self.config)
        return load_gpt(self.model_path, self.config, dtype=self.dtype, device=self.device, attention=self.attention,
                        fp32_lm_head=self.fp32_lm_head, recompute=self.gradient_checkpointing, tp=self.tensor_parallel,
                        ep=self.expert_parallel)

    # ------------------------------------------------------------------ tensor parallelism
    @property
    def data_parallel(self) -> tuple[int, int, bool]:
        from megatron.core import parallel_state as ps

        return (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                ps.get_tensor_model_parallel_rank() == 0)

    @property
    def _tp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_rank()

    @property
    def _ep_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_expert_model_parallel_rank()

    @property
    def _split(self) -> bool:
        return self.tensor_parallel > 1 or self.expert_parallel > 1

    def _forward_sequences(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        if self.tensor_parallel == 1:
            return super()._forward_sequences(mb, with_entropy=with_entropy)
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        logits = self._logits(ids, mb.attention_mask.to(self.device), first)  # this rank's vocabulary rows
        return vocab_parallel_logprobs(logits, ids, first, vocab_start=self._tp_rank * logits.shape[-1],
                                       vocab=self.shape.vocab, with_entropy=with_entropy)

    def _distribution_sequences(self, mb: TrainBatch) -> tuple[Tensor, Tensor, Tensor]:
        if self.tensor_parallel > 1:
            raise ValueError("megatron trainer: a divergence on the student's distribution (MOPD's GKD branch) is "
                             "not supported with tensor_parallel > 1 yet; allowed: tensor_parallel: 1")
        return super()._distribution_sequences(mb)

    def _all_reduce_grads(self, group: Any = None) -> None:
        """Over the data-parallel group: the ranks of one replica hold different shards. First, in
        a replica, the gradients of what every rank holds whole but applied to its own heads or
        tokens only are summed (the q/k norms; under sequence parallelism the norms and routers).
        An expert's gradient holds every expert-parallel rank's tokens already (they were gathered
        to it): it is summed over the ranks holding the same expert only."""
        self._sum_replicated_grads()
        params = self._trained()  # the float32 masters carry the parameters' marks
        for p in params:
            if p.grad is None:  # a rank whose batch never touched this parameter still joins the sum
                p.grad = torch.zeros_like(p)
        for members, group in self._optimizer_buckets(params):
            if members and dist.get_world_size(group) > 1:
                sum_in_place([p.grad for p in members], group)

    def _sum_replicated_grads(self) -> None:
        if self.tensor_parallel > 1:
            sum_replicated_grads([(n, p, self._grad(p)) for n, p in self.model.named_parameters()])

    def _optimizer_buckets(self, params: list[torch.nn.Parameter]) -> list[tuple[list[torch.nn.Parameter], Any]]:
        """Parameters and the ranks holding them alike (the gradient sums, the distributed
        optimizer's buckets): the experts over the ranks holding the same experts, everything else
        over the data-parallel group."""
        from megatron.core import parallel_state as ps

        return [([p for p in params if getattr(p, "allreduce", True)], ps.get_data_parallel_group()),
                ([p for p in params if not getattr(p, "allreduce", True)], ps.get_expert_data_parallel_group())]

    def _reduce_scatter_grads(self) -> None:
        self._sum_replicated_grads()
        super()._reduce_scatter_grads()

    def _clip_grad_norm(self) -> Tensor:
        if self.dist_opt is not None:
            kinds = parameter_kinds()
            return self.dist_opt.clip_grad_norm(self.grad_clip, kind_of=kinds.kind_of, kind_groups=kinds.groups)
        if not self._split:
            return super()._clip_grad_norm()
        return clip_grad_norm(self._trained(), self.grad_clip)

    def save(self, path: str | Path) -> None:
        """The torch trainer's checkpoint (HF-named tensors gathered from the shards); with the
        replica split, each shard's optimizer state beside it (written by the shard's first holder)."""
        from megatron.core import parallel_state

        super().save(path)
        if self._split and self.optimizer is not None:
            state = {"optimizer": self._optimizer_state(),  # a collective under the distributed optimizer
                     "master_weights": self.masters.state() if self.masters is not None else None}
            if parallel_state.get_expert_data_parallel_rank() == 0:
                torch.save(state, Path(path) / self._optimizer_file)

    def load(self, path: str | Path) -> None:
        super().load(path)
        if self._split and self.optimizer is not None:
            state = torch.load(Path(path) / self._optimizer_file, map_location="cpu", weights_only=False)
            self._load_optimizer_state(state["optimizer"])
            if self.masters is not None:
                self.masters.load(state["master_weights"])

    @property
    def _optimizer_file(self) -> str:
        return f"optimizer_tp{self._tp_rank}" + (f"_ep{self._ep_rank}" if self.expert_parallel > 1 else "") + ".pt"

    def _enable_gradient_checkpointing(self) -> None:
        """Nothing to do: Megatron's full-layer recomputation is part of the model's config."""

    def _decoder_layers(self) -> list[torch.nn.Module]:
        return list(self.model.decoder.layers)

    def _logits(self, input_ids: Tensor, attention_mask: Tensor, first: int = 1) -> Tensor:
        routes = None if self._routes is None else self._routes.to(input_ids.device)
        # a recomputed layer routes again in the backward: the routes must be replayed there too
        backward = self.gradient_checkpointing and torch.is_grad_enabled()
        return gpt_logits(self.model, input_ids, attention_mask, first, vocab=self.shape.vocab, routes=routes,
                          replay_in_backward=backward)

    # R3: a micro-batch whose rows carry the engine's routed experts is replayed on them
    def _forward(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        with self._replaying(mb):
            return super()._forward(mb, with_entropy=with_entropy)

    def _forward_distribution(self, mb: TrainBatch) -> tuple[Tensor, Tensor, Tensor]:
        with self._replaying(mb):
            return super()._forward_distribution(mb)

    def train_step(self, mini_batch: TrainBatch, loss_fn: Any, token_budget: int) -> Any:
        """The torch trainer's step; with R3, ``train/r3_replayed_tokens`` counts the tokens whose
        recorded routes its forwards replayed (each row's real tokens, once)."""
        self._replayed_tokens = 0
        try:
            metrics = super().train_step(mini_batch, loss_fn, token_budget)
        finally:
            clear_routes(self.model)  # the last micro-batch's, kept for its backward
        return metrics.total("train/r3_replayed_tokens", self._replayed_tokens) if self._replayed_tokens else metrics

    @contextmanager
    def _replaying(self, mb: TrainBatch) -> Iterator[None]:
        self._routes = micro_batch_routes(mb, self.shape) if self.routing_replay else None
        if self._routes is not None:
            self._replayed_tokens += int(mb.attention_mask.sum())
        try:
            yield
        finally:
            self._routes = None

    # ------------------------------------------------------------------ weights and state
    def _full_model_state(self) -> dict[str, Tensor]:
        return dict(self._hf_tensors())

    def _hf_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors: one rank's own as views; with the replica split, the experts gathered
        on the first expert-parallel rank and the tensor-parallel shards on the replica's first
        rank (collectives of their groups; the other ranks yield nothing)."""
        from megatron.core import parallel_state

        own = {k: v for k, v in self.model.state_dict(keep_vars=True).items() if isinstance(v, Tensor)}
        if self.expert_parallel > 1:
            experts = gathered_state({k: v for k, v in own.items() if not getattr(v, "allreduce", True)},
                                     parallel_state.get_expert_model_parallel_group())
            if experts is None:
                return
            own = merge_expert_shards([{**own, **experts[0]}, *experts[1:]])
        shards = [own] if self.tensor_parallel == 1 else gathered_state(own)
        if shards is None:
            return
        for name, tensor in mcore_to_hf(shards, self.shape):
            yield name, tensor.detach()
            if name == "model.embed_tokens.weight" and self.shape.tied:
                yield "lm_head.weight", tensor.detach()  # as the HF model lists its tied head

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors of the current policy (q/k/v and gate/up split out of Megatron's merged ones)."""
        yield from self._hf_tensors()

    def _load_model_state(self, state: dict[str, Tensor]) -> None:
        load_hf_weights(self.model, state, self.config, rank=self._tp_rank, tp=self.tensor_parallel,
                        ep_rank=self._ep_rank, ep=self.expert_parallel)

    def _write_hf(self, path: Path, state: dict[str, Tensor]) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "generation_config.json"):
            if (Path(self.model_path) / name).is_file():
                shutil.copyfile(Path(self.model_path) / name, path / name)
        tensors = {n: t.contiguous() for n, t in state.items() if not (self.shape.tied and n == "lm_head.weight")}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def micro_batch_routes(mb: TrainBatch, shape: Shape) -> Tensor | None:
    """The rows' recorded routes as one ``[rows, tokens, layers, topk]`` tensor, or None when no row
    carries any (a dense model, or an engine that records none).

    A row's record covers its tokens from the first (the prompt's, as the engine prefilled them);
    its last token was never fed to the engine, and padding never was: those positions get experts
    ``0..topk-1``, which change no trained log-prob (the last token's output predicts nothing, and
    right-padding comes after every real token).
    """
    records = mb.routed_experts
    if not records or all(r is None for r in records):
        return None
    if shape.experts == 0:
        raise ValueError("routed_experts: the batch carries routed experts but the model has no experts")
    if segment_layout(mb) is not None:
        raise ValueError("routed_experts: routing replay of rows with several segments is not supported yet")
    b, t = mb.input_ids.shape
    layers, topk = next(torch.as_tensor(r) for r in records if r is not None).shape[1:]
    routes = torch.arange(topk).expand(b, t, layers, topk).clone()
    lengths = mb.attention_mask.sum(1)
    for row, record in enumerate(records):
        if record is None:
            raise ValueError(f"routed_experts: row {row} has no routes while others do; replay needs every row's")
        record = torch.as_tensor(record, dtype=torch.long)
        if record.shape[1:] != (layers, topk) or len(record) < int(lengths[row]) - 1:
            raise ValueError(f"routed_experts: row {row} holds {list(record.shape)}; expected at least "
                             f"[{int(lengths[row]) - 1}, {layers}, {topk}] (the row's tokens but the last)")
        if int(record.min()) < 0 or int(record.max()) >= shape.experts:
            raise ValueError(f"routed_experts: row {row} names experts outside 0..{shape.experts - 1}")
        start = int(mb.attention_mask[row].argmax())  # the row's first token (after any left padding)
        n = min(len(record), t - start)
        routes[row, start:start + n] = record[:n]
    return routes


def check_layout(config: dict[str, Any], tp: int, world_size: int, ep: int = 1) -> None:
    """One line naming what a tensor- or expert-parallel size does not divide: the trainer's
    ranks, or the model's heads, key/value groups, feed-forward widths or experts."""
    for name, size in (("tensor_parallel", tp), ("expert_parallel", ep)):
        if size < 1 or world_size % size:
            raise ValueError(f"{name}={size} does not divide trainer.world_size={world_size}; allowed: a divisor "
                             f"of {world_size}")
    if world_size % (tp * ep):
        raise ValueError(f"tensor_parallel={tp} x expert_parallel={ep} does not divide trainer.world_size={world_size}; "
                         "allowed: a product that divides it (the experts are split over both)")
    shape = Shape.of(config)
    shape.check_tp(tp)
    shape.check_ep(ep)
    for name in ("intermediate_size", "moe_intermediate_size"):
        if config.get(name) and int(config[name]) % tp:
            raise ValueError(f"tensor_parallel={tp} does not divide {name}={config[name]}; allowed: a divisor of it")


def load_gpt(model_path: str, config: dict[str, Any], *, dtype: str, device: str, attention: str = "sdpa",
             fp32_lm_head: bool = True, recompute: bool = False, tp: int = 1, ep: int = 1) -> torch.nn.Module:
    """This rank's shard of a Megatron GPT model with the HF checkpoint's weights (Megatron's
    process groups started first: ``tp`` ranks a replica, experts over ``ep`` ranks), the output
    layer giving float32 logits where asked."""
    from megatron.core import parallel_state
    from safetensors.torch import load_file

    start_model_parallel(device, tp, ep)
    shape = Shape.of(config)
    model = build_gpt(config, dtype=_DTYPES[dtype], attention=attention, recompute=recompute, tp=tp, ep=ep,
                      padded_vocab=shape.padded_vocab(tp))
    hf = {n: t for p in sorted(Path(model_path).glob("*.safetensors")) for n, t in load_file(str(p)).items()}
    load_hf_weights(model, hf, config, rank=parallel_state.get_tensor_model_parallel_rank(), tp=tp,
                    ep_rank=parallel_state.get_expert_model_parallel_rank(), ep=ep)
    if fp32_lm_head and dtype != "float32":
        fp32_output_layer(model.output_layer)
    return model


def fp32_output_layer(layer: torch.nn.Module) -> None:
    """The output layer's GEMM with float32 logits (the engine's FP32 head: the same kernel) over
    this rank's vocabulary rows. A tied model hands the embedding in as ``weight``. Under tensor
    parallelism the input enters as Megatron's column-parallel layer takes it (identity forward,
    its gradient summed over the ranks' vocabulary shards)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from loongsage.core.embedded.kv_cache import fp32_head

    def forward(input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None,
                **_: Any) -> tuple[Tensor, None]:
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            input_ = copy_to_tensor_model_parallel_region(input_)
        return fp32_head(input_, layer.weight if weight is None else weight), None

    layer.forward = forward


def start_model_parallel(device: str, tp: int = 1, ep: int = 1) -> None:
    """Megatron's process groups over the run's trainer ranks (one process: a group of one of its
    own): replicas of ``tp`` ranks, experts over ``ep`` ranks, pipeline parallelism 1. CPU shims
    when CUDA is absent."""
    from megatron.core import parallel_state, tensor_parallel

    from loongsage.core.placement import free_port
    from loongsage.megatron.cpu import apply_cpu_shims

    if not str(device).startswith("cuda"):
        apply_cpu_shims()
    if not dist.is_initialized():
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        running = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size())
        if running != (tp, ep):
            raise ValueError(f"megatron: this process runs tensor_parallel={running[0]}, expert_parallel={running[1]}; "
                             f"a model asked for {tp}, {ep}")
    else:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                                 expert_model_parallel_size=ep)
        tensor_parallel.model_parallel_cuda_manual_seed(int(torch.initial_seed()) % (2**31))
