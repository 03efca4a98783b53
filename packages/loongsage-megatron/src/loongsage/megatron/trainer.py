"""``megatron``: the trainer backend on a Megatron-Core GPT model (the trainer contract).

The model is built from the HF checkpoint (:mod:`.model`: Transformer Engine's layer where it
imports on a GPU, else the TE-free layer with torch's fused attention) and its weights converted
in (:mod:`.convert`). Everything around the model is the torch trainer's: micro-batches by token
budget, segments scored alone, the loss functions, AdamW with warm-up and clipping, replicated
data parallelism (gradients summed over gloo or NCCL), checkpoints of HF-named tensors (so a
checkpoint moves between the two backends), exports to the engines and to an HF folder. What
differs is the forward: Megatron's ``[batch, seq]`` interface with explicit positions and a
boolean mask, and the conversion at every boundary.

A replica may be split over ranks (:mod:`.parallel`): ``tensor_parallel`` ranks each hold a slice
of every layer and see the same rows; under ``expert_parallel`` each rank holds a block of every
MoE layer's experts and trains on rows of its own (the experts' ranks are data-parallel ranks for
everything else); under ``pipeline_parallel`` each rank holds a stage of consecutive layers, and
the micro-batches run through the stages in Megatron's one-forward-one-backward order
(:mod:`.pipeline`). ``distributed_optimizer`` splits the float32 masters and AdamW state over the
data-parallel ranks, the experts' over the ranks holding them.
"""

from __future__ import annotations

import json
import shutil
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from loongsage.core.embedded.logprobs import logprobs_entropy_and_distribution, response_start
from loongsage.core.embedded.state import sum_in_place
from loongsage.core.embedded.trainer import _DTYPES, TorchTrainer
from loongsage.core.segments import segment_layout
from loongsage.core.types import TrainBatch
from loongsage.megatron.convert import Shape, mcore_to_hf, merge_expert_shards, numbered_from, unfused_norm_names
from loongsage.megatron.layout import Layout
from loongsage.megatron import context
from loongsage.megatron.model import (architecture, build_gpt, check_layer_spec, check_packing, clear_routes,
                                      gpt_hidden, gpt_local_logits, gpt_logits, gpt_packed_logits, load_hf_weights,
                                      resolve_layer_spec, rope_base, stage_layers)
from loongsage.megatron.pipeline import Stage, forward_only, one_forward_one_backward, to_first_stage
from loongsage.megatron.parallel import (clip_grad_norm, gathered_state, parameter_kinds, sum_replicated_grads,
                                        vocab_parallel_distribution, vocab_parallel_logprobs,
                                        vocab_parallel_token_logprobs, vocab_shard, vocab_sum)


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
    layer_spec: str = "auto"  # "te" (Transformer Engine) where it imports on a GPU, else "sdpa"; or "local"
    routing_replay: bool = True  # R3 on an MoE model: replay the engine's routed experts when rows carry them
    tensor_parallel: int = 1  # ranks one replica is split over (trainer.world_size: a multiple of it)
    expert_parallel: int = 1  # ranks an MoE layer's experts are split over (each trains on rows of its own)
    pipeline_parallel: int = 1  # consecutive stages of layers one replica is split into
    expert_tensor_parallel: int | None = None  # ranks one expert is split over (None: tensor_parallel; or 1)
    context_parallel: int = 1  # ranks each holding a share of every sequence's tokens
    pack_sequences: bool = False  # a micro-batch's rows run as one sequence of their real tokens (.packing)
    supports_lora: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_layer_spec(self.layer_spec)  # before Megatron's process groups start
        self.layout = Layout.of({name: getattr(self, name) for name in (
            "tensor_parallel", "pipeline_parallel", "expert_parallel", "expert_tensor_parallel", "context_parallel")})
        self._routes: Tensor | None = None  # the routes of the micro-batch in the forward (R3)
        self._replayed_tokens = 0
        self._stage_input: Tensor | None = None  # the previous pipeline stage's output, in the forward
        self._queued_inputs: deque[Tensor | None] = deque()  # a held teacher's, received ahead of the step
        if self.dp_mode != "replicate":
            raise ValueError(f"megatron trainer: dp_mode={self.dp_mode!r}; allowed: replicate")
        super().__post_init__()

    @classmethod
    def preflight(cls, params: dict[str, Any], model_path: str, *, world_size: int = 1) -> None:
        """The architecture and the parameters, checked in the driver before any actor starts."""
        if params.get("lora") is not None:
            raise ValueError("lora: MegatronTrainer does not support LoRA; leave lora unset")
        check_layer_spec(params.get("layer_spec", "auto"))
        check_packing(bool(params.get("pack_sequences")), params.get("layer_spec", "auto"),
                      params.get("context_parallel", 1))
        config = read_config(model_path)
        architecture(config)
        rope_base(config)
        Layout.of(params).check(config, world_size)

    def _load_model(self) -> torch.nn.Module:
        self.config = read_config(self.model_path)
        self.shape = Shape.of(self.config)
        return load_gpt(self.model_path, self.config, dtype=self.dtype, device=self.device, spec=self.layer_spec,
                        fp32_lm_head=self.fp32_lm_head, recompute=self.gradient_checkpointing, layout=self.layout,
                        packed=self.pack_sequences)

    # ------------------------------------------------------------------ model parallelism
    @property
    def data_parallel(self) -> tuple[int, int, bool]:
        """A replica's ranks get the same rows; its last pipeline stage's first tensor- and
        context-parallel rank answers for it (the log-probs and losses are computed there)."""
        from megatron.core import parallel_state as ps

        return (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
                and ps.is_pipeline_last_stage())

    @cached_property
    def stage(self) -> Stage:
        """This rank's pipeline stage (Megatron's groups, fixed once the model is built)."""
        return Stage.current()

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
        return self.layout.split

    def _forward_sequences(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        if self.context_parallel > 1:
            return self._context_parallel_sequences(mb, with_entropy=with_entropy)
        if self.pack_sequences:
            return self._packed_sequences(mb, with_entropy=with_entropy)
        if self.tensor_parallel == 1:
            return super()._forward_sequences(mb, with_entropy=with_entropy)
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        logits = self._logits(ids, mb.attention_mask.to(self.device), first)  # this rank's vocabulary rows
        return vocab_parallel_logprobs(logits, ids, first, vocab_start=self._tp_rank * logits.shape[-1],
                                       vocab=self.shape.vocab, with_entropy=with_entropy)

    def _packed_sequences(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Packed rows: the head and the log-softmax run on the tokens a log-prob is read from
        only (not on padding, nor before the first trained position); the per-token results go
        back to the rows' positions (zeros elsewhere)."""
        ids = mb.input_ids.to(self.device)
        b, t = ids.shape
        first = max(response_start(mb.response_mask), 1)
        logits, scored = gpt_packed_logits(self.model, ids, mb.attention_mask.to(self.device), first,
                                           input_tensor=self._stage_input, **self._replay(self.device))
        lp, ent = vocab_parallel_token_logprobs(logits, ids[:, 1:][scored][None],
                                                vocab_start=self._tp_rank * logits.shape[-1], vocab=self.shape.vocab,
                                                with_entropy=with_entropy)
        where = scored.nonzero(as_tuple=True)

        def in_rows(values: Tensor) -> Tensor:  # the value read at position p belongs to p + 1
            return F.pad(values.new_zeros(b, t - 1).index_put(where, values[0]), (1, 0))

        return in_rows(lp), None if ent is None else in_rows(ent)

    def _context_parallel_sequences(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Each context-parallel rank scores the tokens it holds (its head, its vocabulary rows
        under tensor parallelism); the per-token results are gathered into whole rows
        (:mod:`loongsage.megatron.context`)."""
        ids = mb.input_ids.to(self.device)
        b, t = ids.shape
        first = max(response_start(mb.response_mask), 1)
        logits, positions = gpt_local_logits(self.model, ids, mb.attention_mask.to(self.device),
                                             input_tensor=self._stage_input)
        following = F.pad(ids, (0, len(positions) * self.context_parallel - t + 1))[:, positions.to(self.device) + 1]
        lp, ent = vocab_parallel_token_logprobs(logits, following, vocab_start=self._tp_rank * logits.shape[-1],
                                                vocab=self.shape.vocab, with_entropy=with_entropy)
        trained = (torch.arange(t, device=self.device) >= first).to(lp.dtype)  # zeros before the first, as unsplit
        # position p's logits predict token p + 1
        lp = F.pad(context.GatherTokens.apply(lp, 1)[:, :t - 1], (1, 0)) * trained
        if ent is not None:
            ent = F.pad(context.GatherTokens.apply(ent, 1)[:, :t - 1], (1, 0)) * trained
        return lp, ent

    def _distribution_sequences(self, mb: TrainBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Under tensor parallelism, for a divergence summed over the vocabulary's shards (the
        step's ``_vocab_sum`` set), this rank's shard of the log-softmax; for any other the ranks'
        vocabulary rows are gathered first (the gradient goes back to each rank's own rows): a
        divergence over a teacher's top-k reads tokens of every rank."""
        if self.context_parallel > 1:
            raise ValueError("megatron trainer: a divergence on the student's distribution (MOPD's GKD branch) is not "
                             "supported with context_parallel > 1 yet; allowed: context_parallel: 1, or a sampled-token "
                             "divergence (k2, k3)")
        if self.tensor_parallel == 1:
            return super()._distribution_sequences(mb)
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        logits = self._logits(ids, mb.attention_mask.to(self.device), first)  # this rank's vocabulary rows
        if self._vocab_sum is not None:
            return vocab_parallel_distribution(logits, ids, first, vocab_start=self._tp_rank * logits.shape[-1],
                                               vocab=self.shape.vocab)
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)[..., :self.shape.vocab]
        return logprobs_entropy_and_distribution(logits, ids, first, mb.teacher_dist_ids)

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
        """Within a replica: the tensor-parallel ranks' shares of what each holds whole, and the
        two pipeline stages' gradients of a tied embedding (the first stage's embedding, the
        last's copy as its output layer), so that both copies take the same step."""
        from megatron.core import parallel_state as ps

        if self.tensor_parallel > 1:
            sum_replicated_grads([(n, p, self._grad(p)) for n, p in self.model.named_parameters()])
        if self.pipeline_parallel > 1 and self.shape.tied and ps.is_rank_in_embedding_group():
            dist.all_reduce(self._grad(self.model.shared_embedding_or_output_weight()), group=ps.get_embedding_group())

    def _optimizer_buckets(self, params: list[torch.nn.Parameter]) -> list[tuple[list[torch.nn.Parameter], Any]]:
        """Parameters and the ranks holding them alike (the gradient sums, the distributed
        optimizer's buckets): the experts over the ranks holding the same experts, everything else
        over the data-parallel group (with the context-parallel ranks, each of which holds the
        contributions of its own tokens)."""
        from megatron.core import parallel_state as ps

        return [([p for p in params if getattr(p, "allreduce", True)],
                 ps.get_data_parallel_group(with_context_parallel=True)),
                ([p for p in params if not getattr(p, "allreduce", True)], ps.get_expert_data_parallel_group())]

    def _reduce_scatter_grads(self) -> None:
        self._sum_replicated_grads()
        super()._reduce_scatter_grads()

    def _clip_grad_norm(self) -> Tensor:
        if self.dist_opt is not None:
            kinds = parameter_kinds()
            return self.dist_opt.clip_grad_norm(self.grad_clip, kind_of=kinds.kind_of, kind_groups=kinds.groups,
                                                across=kinds.across)
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
    def _optimizer_in_trainer_file(self) -> bool:
        return not self._split

    @property
    def _optimizer_file(self) -> str:
        return (f"optimizer_tp{self._tp_rank}" + (f"_ep{self._ep_rank}" if self.expert_parallel > 1 else "")
                + (f"_pp{self.stage.index}" if self.pipeline_parallel > 1 else "") + ".pt")

    def _enable_gradient_checkpointing(self) -> None:
        """Nothing to do: Megatron's full-layer recomputation is part of the model's config."""

    def _decoder_layers(self) -> list[torch.nn.Module]:
        return list(self.model.decoder.layers)

    def _logits(self, input_ids: Tensor, attention_mask: Tensor, first: int = 1) -> Tensor:
        if self.context_parallel > 1:  # (a filler pass: every rank's forward, nothing read)
            return gpt_local_logits(self.model, input_ids, attention_mask, input_tensor=self._stage_input)[0]
        return gpt_logits(self.model, input_ids, attention_mask, first, vocab=self.shape.vocab,
                          input_tensor=self._stage_input, **self._replay(input_ids.device))

    def _replay(self, device: torch.device) -> dict[str, Any]:
        # a recomputed layer routes again in the backward: the routes must be replayed there too
        return {"routes": None if self._routes is None else self._routes.to(device),
                "replay_in_backward": self.gradient_checkpointing and torch.is_grad_enabled()}

    # ------------------------------------------------------------------ pipeline parallelism
    def _run_micro_batches(self, plans: list[tuple[list[int], TrainBatch] | None], step: Any, *,
                           backward: bool) -> None:
        """Under pipeline parallelism the stages run the micro-batches in Megatron's
        one-forward-one-backward order: the last stage runs ``step`` (the head and the loss) on
        the hidden states it receives, every other stage its layers."""
        if self.pipeline_parallel == 1:
            return super()._run_micro_batches(plans, step, backward=backward)
        stage = self.stage
        padding_routes = self._padding_routes(plans) if backward else None

        def forward(i: int, received: Tensor | None) -> Tensor | None:
            planned = plans[i]
            self._routes = padding_routes if planned is None else None
            try:
                if not stage.last:
                    return self._stage_hidden(planned, received)
                self._stage_input = received
                return step(planned)
            finally:
                self._stage_input = self._routes = None

        schedule = one_forward_one_backward if backward else forward_only
        schedule(stage, len(plans), forward, dtype=_DTYPES[self.dtype], device=self.device)

    def _stage_hidden(self, planned: tuple[list[int], TrainBatch] | None, received: Tensor | None) -> Tensor:
        """A stage before the last: its layers' output for a micro-batch (its rows split into
        segments as the last stage scores them)."""
        if planned is None:
            filler = self._filler()
            return gpt_hidden(self.model, filler, torch.ones_like(filler), input_tensor=received,
                              **self._replay(filler.device))
        mb = planned[1]
        layout = segment_layout(mb)
        rows = mb if layout is None else layout.split_batch(mb)
        with self._replaying(mb):
            return gpt_hidden(self.model, rows.input_ids.to(self.device), rows.attention_mask.to(self.device),
                              input_tensor=received, **self._replay(self.device))

    # ------------------------------------------------------------------ held teachers (MOPD)
    def _teacher_overrides(self) -> dict[str, Any]:
        """A held teacher routes its own tokens: the student's recorded routes are not its."""
        return {**super()._teacher_overrides(), "routing_replay": False}

    def _teachers_ahead(self, plans: list[tuple[list[int], TrainBatch] | None]) -> None:
        """Under pipeline parallelism each held teacher's stages before the last run their layers
        on the step's micro-batches first (its rows of each, a filler where it has none); its last
        stage keeps what it receives, and finishes each micro-batch (its layers, head and
        distribution) beside the student's loss, in the same order."""
        if self.pipeline_parallel == 1:
            return
        for sources, teacher in self.teachers.held:
            teacher._queued_inputs.clear()
            with torch.no_grad():
                teacher._run_micro_batches(self.teachers.planned(plans, sources),
                                           lambda _: teacher._queued_inputs.append(teacher._stage_input),
                                           backward=False)

    def teacher_distribution(self, mb: TrainBatch) -> Tensor:
        with self._queued_input():
            return super().teacher_distribution(mb)

    def teacher_filler(self) -> None:
        with self._queued_input():
            super().teacher_filler()

    @contextmanager
    def _queued_input(self) -> Iterator[None]:
        """On a last pipeline stage, the next micro-batch's input received ahead of the step."""
        if self.pipeline_parallel > 1 and self.stage.last:
            self._stage_input = self._queued_inputs.popleft()
        try:
            yield
        finally:
            self._stage_input = None

    def _padding_routes(self, plans: list[tuple[list[int], TrainBatch] | None]) -> Tensor | None:
        """Routes for a zero-weight padding pass when some rank's micro-batches are replayed with
        recomputation: every forward must then queue routes, or a recomputation would take
        another micro-batch's (experts ``0..k-1`` for the two padding tokens)."""
        if not (self.routing_replay and self.gradient_checkpointing and self.shape.experts):
            return None
        replays = torch.tensor([int(any(p is not None and p[1].routed_experts and any(
            r is not None for r in p[1].routed_experts) for p in plans))])
        dist.all_reduce(replays, op=dist.ReduceOp.MAX)
        if not int(replays):
            return None
        topk = int(self.config["num_experts_per_tok"])
        return torch.arange(topk).expand(1, 2, self.shape.layers, topk)

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
        clear_routes(self.model)
        if self.tensor_parallel > 1 and getattr(loss_fn, "reads_vocab_shards", False):
            # the divergence sums over the vocabulary's shards: the student, its held teachers and a
            # teacher worker's whole distribution all come as this rank's shard
            for trainer in (self, *self.teachers.models()):
                trainer._vocab_sum = vocab_sum
            if mini_batch.teacher_dist_logprobs is not None:
                rows = self.shape.padded_vocab(self.tensor_parallel) // self.tensor_parallel
                mini_batch = replace(mini_batch, teacher_dist_logprobs=vocab_shard(
                    mini_batch.teacher_dist_logprobs, self._tp_rank * rows, rows))
        try:
            metrics = super().train_step(mini_batch, loss_fn, token_budget)
        finally:
            clear_routes(self.model)  # the last micro-batch's, kept for its backward
            for trainer in (self, *self.teachers.models()):
                trainer._vocab_sum = None
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
        on the first expert-parallel rank, the tensor-parallel shards on the stage's first rank,
        and the pipeline stages' tensors on the first stage (collectives of their groups; the
        other ranks yield nothing)."""
        own = unfused_norm_names({k: v for k, v in self.model.state_dict(keep_vars=True).items()
                                  if isinstance(v, Tensor) and not k.endswith("_extra_state")})
        if self.shape.tied and not self.model.pre_process:
            own.pop("output_layer.weight", None)  # the last stage's copy of the embedding
        shards = self._gathered(own)
        if shards is None:
            return
        start = stage_layers(self.shape.layers).start

        def stage_tensors() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in mcore_to_hf([numbered_from(s, start) for s in shards], self.shape,
                                            experts_split=self.layout.expert_tp > 1):
                yield name, tensor.detach()
                if name == "model.embed_tokens.weight" and self.shape.tied:
                    yield "lm_head.weight", tensor.detach()  # as the HF model lists its tied head

        if self.pipeline_parallel == 1:
            yield from stage_tensors()
        else:  # one replica's stages send theirs to its first
            yield from to_first_stage(self.stage, stage_tensors, self.device)

    def _gathered(self, own: dict[str, Tensor]) -> list[dict[str, Tensor]] | None:
        """A stage's whole state as its tensor-parallel ranks' shards, on the first rank of the first
        data-parallel replica (None elsewhere): the experts gathered over the expert-parallel ranks
        (each block renumbered), then the shards over the tensor-parallel ranks. Experts that are
        whole on each rank (expert tensor parallelism 1) go with the first shard only."""
        from megatron.core import parallel_state as ps

        layout = self.layout
        whole_experts = layout.expert_tp == 1 and layout.tp > 1
        experts = {k: v for k, v in own.items() if not getattr(v, "allreduce", True)}
        if whole_experts:
            own = {k: v for k, v in own.items() if k not in experts}
        if layout.ep > 1:
            blocks = gathered_state(experts, ps.get_expert_model_parallel_group())
            experts = merge_expert_shards(blocks) if blocks is not None else None
            if experts is None and not whole_experts:
                return None  # the experts' first rank holds its tensor-parallel group's whole state
            if not whole_experts:
                own = {**own, **experts}
        shards = [own] if layout.tp == 1 else gathered_state(own)
        if shards is None or ps.get_data_parallel_rank() != 0:
            return None
        if whole_experts:  # on the first tensor-parallel rank, which is the experts' first rank
            shards[0] = {**shards[0], **experts}
        return shards

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors of the current policy (q/k/v and gate/up split out of Megatron's merged ones)."""
        yield from self._hf_tensors()

    def _load_model_state(self, state: dict[str, Tensor]) -> None:
        load_hf_weights(self.model, state, self.config, self.layout)

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
    carries any (a dense model, or an engine that records none). A batch with rows of several
    segments gives the routes of its forward's sequences (one per segment, each from its own
    record, as :meth:`~loongsage.core.segments.SegmentLayout.split_batch` lays them out).

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
    layout = segment_layout(mb)
    if layout is not None:  # the routes of the forward's sequences, one per segment of a split row
        return micro_batch_routes(layout.split_batch(mb), shape)
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


def load_gpt(model_path: str, config: dict[str, Any], *, dtype: str, device: str, spec: str = "auto",
             fp32_lm_head: bool = True, recompute: bool = False, layout: Layout = Layout(),
             packed: bool = False) -> torch.nn.Module:
    """This rank's shard of a Megatron GPT model of layer spec ``spec`` (:func:`resolve_layer_spec`)
    with the HF checkpoint's weights (Megatron's process groups started first, as ``layout``
    says), the output layer giving float32 logits where asked."""
    from safetensors.torch import load_file

    layout.start(device)
    shape = Shape.of(config)
    spec = resolve_layer_spec(spec, device, layout)
    model = build_gpt(config, dtype=_DTYPES[dtype], spec=spec, recompute=recompute, layout=layout, packed=packed,
                      padded_vocab=shape.padded_vocab(layout.tp))
    hf = {n: t for p in sorted(Path(model_path).glob("*.safetensors")) for n, t in load_file(str(p)).items()}
    load_hf_weights(model, hf, config, layout)
    if fp32_lm_head and dtype != "float32" and model.post_process:
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
