"""The Megatron trainer's model adapter (the core's ``ModelAdapter``): a Megatron-Core GPT model,
one replica split over ranks as its :class:`~loongsage.megatron.layout.Layout` says.

The model is built from the HF checkpoint (:mod:`.model`: Transformer Engine's layer where it
imports on a GPU, else the TE-free layer with torch's fused attention) and its weights converted
in (:mod:`.convert`); its state goes out HF-named (:mod:`.weights`), so a checkpoint moves between the
two trainer backends. The forward is Megatron's ``[batch, seq]`` interface with explicit positions
and a boolean mask, on each rank's share of the work:

* ``tensor_parallel``: each rank holds a slice of every layer and its rows of the vocabulary; the
  log-probs are reduced over the shards (:mod:`.parallel`), and a divergence summed over the
  vocabulary reads this rank's shard only (the adapter's ``vocab_split``);
* ``context_parallel``: each rank scores the tokens it holds (:mod:`.context`);
* ``pack_sequences``: a micro-batch's rows run as one sequence of their real tokens (:mod:`.packing`);
* ``pipeline_parallel``: each rank holds a stage of consecutive layers and the micro-batches run
  through the stages in the one-forward-one-backward order (:mod:`.pipeline`); a held teacher's
  early stages run their layers before the step (``run_ahead``);
* ``expert_parallel``: each rank holds a block of every MoE layer's experts; their gradients are
  summed over the ranks holding the same experts (the adapter's optimizer buckets);
* R3 (``routing_replay``): a micro-batch whose rows carry the engine's routed experts is replayed
  on them (:mod:`.replay`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from loongsage.core.metrics import Metrics
from loongsage.core.model_math.dtypes import DTYPES
from loongsage.core.model_math.logprobs import logprobs_and_entropy, logprobs_entropy_and_distribution, response_start
from loongsage.core.segments import segment_layout
from loongsage.core.trainer.adapter import (
    MicroBatchStep,
    OptimizerFile,
    Planned,
    VocabSplit,
    filler_input,
    run_in_order,
)
from loongsage.core.types import TrainBatch
from loongsage.megatron import context, weights
from loongsage.megatron.convert import Shape
from loongsage.megatron.forward import (
    clear_routes,
    gpt_hidden,
    gpt_local_logits,
    gpt_logits,
    gpt_packed_logits,
)
from loongsage.megatron.layout import Layout
from loongsage.megatron.model import load_hf_weights
from loongsage.megatron.parallel import (
    clip_grad_norm,
    parameter_kinds,
    sum_replicated_grads,
    vocab_parallel_distribution,
    vocab_parallel_logprobs,
    vocab_parallel_token_logprobs,
    vocab_shard,
    vocab_sum,
)
from loongsage.megatron.pipeline import Stage, forward_only, one_forward_one_backward
from loongsage.megatron.replay import micro_batch_routes, padding_routes


class MegatronModel:
    """This rank's shard of a Megatron-Core GPT model built from ``model_path`` (see the module
    docstring); ``recompute``: full-layer recomputation in the backward."""

    sharded = False  # a replica's ranks hold different parts; its data-parallel replicas, the same
    reference = None  # no second copy of the starting policy
    shares_prompts = False  # packed rows: each row's prompt is computed in it

    def __init__(
        self,
        model_path: str,
        *,
        layout: Layout,
        dtype: str,
        device: str,
        fp32_lm_head: bool,
        recompute: bool,
        layer_spec: str,
        pack_sequences: bool,
        routing_replay: bool,
        fp8: str | None = None,
        fp8_recipe: str = "delayed",
    ) -> None:
        self.model_path, self.layout, self.dtype, self.device = model_path, layout, dtype, device
        self.recompute, self.pack_sequences, self.routing_replay = recompute, pack_sequences, routing_replay
        self._routes: Tensor | None = None  # the routes of the micro-batch in the forward (R3)
        self._replayed_tokens = 0
        self._stage_input: Tensor | None = None  # the previous pipeline stage's output, in the forward
        self._queued_inputs: deque[Tensor | None] = deque()  # a held teacher's, received ahead of the step
        self.config = weights.read_config(model_path)
        self.shape = Shape.of(self.config)
        self.model = weights.load_gpt(
            model_path,
            self.config,
            dtype=dtype,
            device=device,
            spec=layer_spec,
            fp32_lm_head=fp32_lm_head,
            recompute=recompute,
            layout=layout,
            packed=pack_sequences,
            fp8=fp8,
            fp8_recipe=fp8_recipe,
        )
        self.model.to(device)
        self.model.train()

    # ------------------------------------------------------------------ the split
    @property
    def data_parallel(self) -> tuple[int, int, bool]:
        """A replica's ranks get the same rows; its last pipeline stage's first tensor- and
        context-parallel rank answers for it (the log-probs and losses are computed there)."""
        from megatron.core import parallel_state as ps

        return (
            ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size(),
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0
            and ps.is_pipeline_last_stage(),
        )

    @cached_property
    def stage(self) -> Stage:
        """This rank's pipeline stage (Megatron's groups, fixed once the model is built)."""
        return Stage.current()

    @property
    def _tp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_rank()

    @property
    def vocab_split(self) -> VocabSplit | None:
        if self.layout.tp == 1:
            return None
        rows = self.shape.padded_vocab(self.layout.tp) // self.layout.tp
        start = self._tp_rank * rows
        return VocabSplit(sum=vocab_sum, own=lambda full: vocab_shard(full, start, rows))

    @property
    def optimizer_file(self) -> OptimizerFile | None:
        """With the replica split, each shard's optimizer state in a file of its own, written by the
        shard's first holder."""
        if not self.layout.split:
            return None
        from megatron.core import parallel_state as ps

        name = (
            f"optimizer_tp{self._tp_rank}"
            + (f"_ep{ps.get_expert_model_parallel_rank()}" if self.layout.ep > 1 else "")
            + (f"_pp{self.stage.index}" if self.layout.pp > 1 else "")
            + ".pt"
        )
        return OptimizerFile(name, writes=ps.get_expert_data_parallel_rank() == 0)

    # ------------------------------------------------------------------ the forward
    def logits(self, input_ids: Tensor, attention_mask: Tensor, first: int = 1) -> Tensor:
        """Float32 logits at positions ``first-1..T-1`` (this rank's vocabulary rows; on a last
        pipeline stage, from the input the previous stage sent)."""
        if self.layout.cp > 1:  # (a filler pass: every rank's forward, nothing read)
            return gpt_local_logits(self.model, input_ids, attention_mask, input_tensor=self._stage_input)[0]
        return gpt_logits(
            self.model,
            input_ids,
            attention_mask,
            first,
            vocab=self.shape.vocab,
            input_tensor=self._stage_input,
            **self._replay(input_ids.device),
        )

    def filler_logits(self) -> Tensor:
        filler = filler_input(self.device)
        return self.logits(filler, torch.ones_like(filler))

    def _replay(self, device: torch.device) -> dict[str, Any]:
        # a recomputed layer routes again in the backward: the routes must be replayed there too
        return {
            "routes": None if self._routes is None else self._routes.to(device),
            "replay_in_backward": self.recompute and torch.is_grad_enabled(),
        }

    @contextmanager
    def forwarding(self, mb: TrainBatch) -> Iterator[None]:
        """R3: a micro-batch whose rows carry the engine's routed experts is replayed on them."""
        self._routes = micro_batch_routes(mb, self.shape) if self.routing_replay else None
        if self._routes is not None:
            self._replayed_tokens += int(mb.attention_mask.sum())
        try:
            yield
        finally:
            self._routes = None

    @contextmanager
    def stepping(self, metrics: Metrics) -> Iterator[None]:
        """With R3, ``train/r3_replayed_tokens`` counts the tokens whose recorded routes the step's
        forwards replayed (each row's real tokens, once)."""
        self._replayed_tokens = 0
        clear_routes(self.model)
        try:
            yield
        finally:
            clear_routes(self.model)  # the last micro-batch's, kept for its backward
        if self._replayed_tokens:
            metrics.total("train/r3_replayed_tokens", self._replayed_tokens)

    def sequence_logprobs(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        if self.layout.cp > 1:
            return self._context_parallel_sequences(mb, with_entropy=with_entropy)
        if self.pack_sequences:
            return self._packed_sequences(mb, with_entropy=with_entropy)
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        logits = self.logits(ids, mb.attention_mask.to(self.device), first)  # this rank's vocabulary rows
        if self.layout.tp == 1:
            return logprobs_and_entropy(logits, ids, first, with_entropy=with_entropy)
        return vocab_parallel_logprobs(
            logits,
            ids,
            first,
            vocab_start=self._tp_rank * logits.shape[-1],
            vocab=self.shape.vocab,
            with_entropy=with_entropy,
        )

    def _packed_sequences(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Packed rows: the head and the log-softmax run on the tokens a log-prob is read from
        only (not on padding, nor before the first trained position); the per-token results go
        back to the rows' positions (zeros elsewhere)."""
        ids = mb.input_ids.to(self.device)
        b, t = ids.shape
        first = max(response_start(mb.response_mask), 1)
        logits, scored = gpt_packed_logits(
            self.model,
            ids,
            mb.attention_mask.to(self.device),
            first,
            input_tensor=self._stage_input,
            **self._replay(self.device),
        )
        lp, ent = vocab_parallel_token_logprobs(
            logits,
            ids[:, 1:][scored][None],
            vocab_start=self._tp_rank * logits.shape[-1],
            vocab=self.shape.vocab,
            with_entropy=with_entropy,
        )
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
        logits, positions = gpt_local_logits(
            self.model, ids, mb.attention_mask.to(self.device), input_tensor=self._stage_input
        )
        following = F.pad(ids, (0, len(positions) * self.layout.cp - t + 1))[:, positions.to(self.device) + 1]
        lp, ent = vocab_parallel_token_logprobs(
            logits,
            following,
            vocab_start=self._tp_rank * logits.shape[-1],
            vocab=self.shape.vocab,
            with_entropy=with_entropy,
        )
        trained = (torch.arange(t, device=self.device) >= first).to(lp.dtype)  # zeros before the first, as unsplit
        # position p's logits predict token p + 1
        lp = F.pad(context.GatherTokens.apply(lp, 1)[:, : t - 1], (1, 0)) * trained
        if ent is not None:
            ent = F.pad(context.GatherTokens.apply(ent, 1)[:, : t - 1], (1, 0)) * trained
        return lp, ent

    def sequence_distribution(self, mb: TrainBatch, *, shards: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Under tensor parallelism, for a divergence summed over the vocabulary's shards
        (``shards``), this rank's shard of the log-softmax; for any other the ranks' vocabulary
        rows are gathered first (the gradient goes back to each rank's own rows): a divergence over
        a teacher's top-k reads tokens of every rank."""
        if self.layout.cp > 1:
            raise ValueError(
                "megatron trainer: a divergence on the student's distribution (MOPD's GKD branch) is not "
                "supported with context_parallel > 1 yet; allowed: context_parallel: 1, or a sampled-token "
                "divergence (k2, k3)"
            )
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        logits = self.logits(ids, mb.attention_mask.to(self.device), first)  # this rank's vocabulary rows
        if self.layout.tp == 1:
            return logprobs_entropy_and_distribution(logits, ids, first, mb.teacher_dist_ids)
        if shards:
            return vocab_parallel_distribution(
                logits, ids, first, vocab_start=self._tp_rank * logits.shape[-1], vocab=self.shape.vocab
            )
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)[..., : self.shape.vocab]
        return logprobs_entropy_and_distribution(logits, ids, first, mb.teacher_dist_ids)

    # ------------------------------------------------------------------ pipeline parallelism
    def run_micro_batches(self, plans: list[Planned], step: MicroBatchStep, *, backward: bool) -> None:
        """Under pipeline parallelism the stages run the micro-batches in Megatron's
        one-forward-one-backward order: the last stage runs ``step`` (the head and the loss) on
        the hidden states it receives, every other stage its layers."""
        if self.layout.pp == 1:
            return run_in_order(plans, step, backward=backward)
        stage = self.stage
        filler_routes = self._padding_routes(plans) if backward else None

        def forward(i: int, received: Tensor | None) -> Tensor | None:
            planned = plans[i]
            self._routes = filler_routes if planned is None else None
            try:
                if not stage.last:
                    return self._stage_hidden(planned, received)
                self._stage_input = received
                return step(planned)
            finally:
                self._stage_input = self._routes = None

        schedule = one_forward_one_backward if backward else forward_only
        schedule(stage, len(plans), forward, dtype=DTYPES[self.dtype], device=self.device)

    def _stage_hidden(self, planned: Planned, received: Tensor | None) -> Tensor:
        """A stage before the last: its layers' output for a micro-batch (its rows split into
        segments as the last stage scores them)."""
        if planned is None:
            filler = filler_input(self.device)
            return gpt_hidden(
                self.model, filler, torch.ones_like(filler), input_tensor=received, **self._replay(filler.device)
            )
        mb = planned[1]
        layout = segment_layout(mb)
        rows = mb if layout is None else layout.split_batch(mb)
        with self.forwarding(mb):
            return gpt_hidden(
                self.model,
                rows.input_ids.to(self.device),
                rows.attention_mask.to(self.device),
                input_tensor=received,
                **self._replay(self.device),
            )

    def _padding_routes(self, plans: list[Planned]) -> Tensor | None:
        """Routes for the zero-weight filler passes when some rank replays routes with
        recomputation (:func:`~loongsage.megatron.replay.padding_routes`)."""
        if not (self.routing_replay and self.recompute and self.shape.experts):
            return None
        return padding_routes(plans, self.shape, self.config)

    def run_ahead(self, plans: list[Planned]) -> None:
        """As a held teacher under pipeline parallelism: the stages before the last run their
        layers on the step's micro-batches first (its rows of each, a filler where it has none);
        the last stage keeps what it receives, and finishes each micro-batch (its layers, head and
        distribution) beside the student's loss, in the same order."""
        if self.layout.pp == 1:
            return
        self._queued_inputs.clear()
        with torch.no_grad():
            self.run_micro_batches(plans, lambda _: self._queued_inputs.append(self._stage_input), backward=False)

    @contextmanager
    def ahead_input(self) -> Iterator[None]:
        """On a last pipeline stage, the next micro-batch's input received ahead of the step."""
        if self.layout.pp > 1 and self.stage.last:
            self._stage_input = self._queued_inputs.popleft()
        try:
            yield
        finally:
            self._stage_input = None

    # ------------------------------------------------------------------ gradients
    def optimizer_buckets(self, params: list[torch.nn.Parameter]) -> list[tuple[list[torch.nn.Parameter], Any]]:
        """Parameters and the ranks holding them alike (the gradient sums, the distributed
        optimizer's buckets): the experts over the ranks holding the same experts, everything else
        over the data-parallel group (with the context-parallel ranks, each of which holds the
        contributions of its own tokens). An expert's gradient holds every expert-parallel rank's
        tokens already (they were gathered to it)."""
        from megatron.core import parallel_state as ps

        return [
            (
                [p for p in params if getattr(p, "allreduce", True)],
                ps.get_data_parallel_group(with_context_parallel=True),
            ),
            ([p for p in params if not getattr(p, "allreduce", True)], ps.get_expert_data_parallel_group()),
        ]

    def sum_replica_grads(self, grad_of: Callable[[torch.nn.Parameter], Tensor | None]) -> None:
        """Within a replica: the tensor-parallel ranks' shares of what each holds whole but applies
        to its own heads or tokens only (the q/k norms; under sequence parallelism the norms and
        routers), and the two pipeline stages' gradients of a tied embedding (the first stage's
        embedding, the last's copy as its output layer), so that both copies take the same step."""
        from megatron.core import parallel_state as ps

        if self.layout.tp > 1:
            sum_replicated_grads([(n, p, grad_of(p)) for n, p in self.model.named_parameters()])
        if self.layout.pp > 1 and self.shape.tied and ps.is_rank_in_embedding_group():
            dist.all_reduce(grad_of(self.model.shared_embedding_or_output_weight()), group=ps.get_embedding_group())

    def clip_grad_norm(self, params: list[Tensor], max_norm: float, dist_opt: Any) -> Tensor:
        """Each parameter's square counted over the ranks sharing it (:class:`~.parallel.ParameterKinds`)."""
        if dist_opt is not None:
            kinds = parameter_kinds()
            return dist_opt.clip_grad_norm(
                max_norm, kind_of=kinds.kind_of, kind_groups=kinds.groups, across=kinds.across
            )
        if not self.layout.split:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return clip_grad_norm(params, max_norm)

    # ------------------------------------------------------------------ weights and state
    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors of the current policy (q/k/v and gate/up split out of Megatron's merged ones)."""
        yield from weights.hf_tensors(
            self.model, self.shape, self.layout, self.device, stage=self.stage if self.layout.pp > 1 else None
        )

    def checkpoint_state(self) -> dict[str, Tensor]:
        return dict(self.export_weights())

    def load_checkpoint_state(self, tensors: dict[str, Tensor]) -> None:
        load_hf_weights(self.model, tensors, self.config, self.layout)

    def hf_state(self) -> dict[str, Tensor]:
        return dict(self.export_weights())

    def write_hf(self, path: Path, tensors: dict[str, Tensor]) -> None:
        weights.write_hf(path, tensors, self.model_path, self.shape)
