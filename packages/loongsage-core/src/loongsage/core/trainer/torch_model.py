"""The torch trainer's model adapter (:class:`~loongsage.core.trainer.adapter.ModelAdapter`): an HF
causal LM, whole on every rank or sharded by FSDP2, optionally with LoRA adapters.

Data parallelism (``world_size > 1``, over a gloo process group on CPU or NCCL on GPU):
``dp_mode="fsdp2"`` shards every decoder layer and the root with FSDP2; ``"replicate"`` keeps a full
replica per rank (the skeleton all-reduces its gradients). FSDP2's reduction is switched from its
default mean to a sum: the loss weights already carry the global denominators, so the sum over
ranks is exactly the full-batch gradient.

The forward is :func:`~loongsage.core.model_math.logprobs.policy_logits`: the LM head only from the
first trained position on, in float32 for a bf16/fp16 model (the FP32 head the engine shares).
Under LoRA (:mod:`.lora`) only the adapters train, the model with them switched off is the frozen
reference, a checkpoint holds the adapters alone, and exports hold the merged weights.

``compile_layers`` compiles each decoder layer with ``torch.compile`` (regional compilation): Inductor
fuses the norms, rotary embedding and activation of the layer's forward and backward into a few
Triton kernels, where eager HF runs each as separate elementwise kernels, rounding where eager
rounds (:mod:`.compiling`: the engine's kernels round there too). The layers share one
compiled graph (parameters are the graph's inputs; the forward keeps no KV cache, whose per-layer
index would make a graph per layer), so compiling costs one layer's time, not the model's; the second
distinct micro-batch shape recompiles once with dynamic shapes. Under ``share_prompts`` the parts
around each layer's attention are compiled instead (:func:`.shared_prompts.compile_around_attention`).

``head_chunk_tokens`` runs the FP32 head and its log-softmax that many tokens at a time
(:mod:`~loongsage.core.model_math.chunked_head`), so the float32 logits of a whole micro-batch never
exist at once; 0 keeps the one-piece head.

``share_prompts`` computes a prompt once for all the rows of a micro-batch that begin with it (the
samples of a GRPO group), in two passes over the model's body (:mod:`.shared_prompts`), where that
computes fewer tokens than the plain forward; the step's ``train/shared_prompt_tokens`` counts the
prompt tokens not computed again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from loongsage.core.metrics import Metrics
from loongsage.core.model_math.chunked_head import chunked_head_logprobs, chunked_logprobs_and_entropy
from loongsage.core.model_math.dtypes import DTYPES
from loongsage.core.model_math.fp8_linear import use_fp8
from loongsage.core.model_math.logprobs import (
    head_logits,
    logprobs_and_entropy,
    logprobs_entropy_and_distribution,
    policy_logits,
    response_start,
)
from loongsage.core.model_math.state import state_tensors
from loongsage.core.trainer.adapter import MicroBatchStep, Planned, filler_input, run_in_order, world_size
from loongsage.core.trainer.compiling import compile_like_eager
from loongsage.core.trainer.lora import (
    LoraConfig,
    adapter_state,
    adapters_disabled,
    add_adapters,
    load_adapter_state,
    merged_state,
    merged_weights,
)
from loongsage.core.trainer.micro_batching import PASS_OVERHEAD_TOKENS
from loongsage.core.trainer.shared_prompts import (
    PromptGroups,
    check_attention,
    compile_around_attention,
    shared_groups,
    shared_prompt_hidden,
    trained_columns,
)
from loongsage.core.types import TrainBatch


class TorchModel:
    """An HF causal LM on ``device`` in ``dtype``, split over the data-parallel ranks as ``dp_mode``
    says (see the module docstring). A subclass loads another model (:meth:`_load`) or scores
    another per-token output (:meth:`sequence_logprobs`): the critic's value model."""

    vocab_split = None  # every rank holds the whole vocabulary
    optimizer_file = None  # every rank holds the whole optimizer state, or FSDP2 gathers it

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        device: str,
        fp32_lm_head: bool,
        gradient_checkpointing: bool,
        dp_mode: str,
        lora: LoraConfig | None,
        compile_layers: bool = False,
        head_chunk_tokens: int = 0,
        batch_invariant: bool = False,
        share_prompts: bool = False,
        fp8: tuple[str, str] | None = None,
    ) -> None:
        self.device, self.fp32_lm_head, self.lora = device, fp32_lm_head, lora
        self.head_chunk_tokens = head_chunk_tokens
        self.model = self._load(model_path, dtype)
        self.shares_prompts = share_prompts
        self.shared_prompt_tokens = 0  # in the step under way (:meth:`stepping`)
        if share_prompts:
            check_attention(self.model)
        if lora is not None:
            self._add_lora(lora, gradient_checkpointing)
        self.model.to(device)
        if fp8 is not None:  # (format, recipe): the decoder layers' projections run their GEMMs in FP8
            use_fp8(self._decoder_layers(), *fp8)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        world = world_size()
        self.rank = dist.get_rank() if world > 1 else 0
        self.sharded = world > 1 and dp_mode == "fsdp2"
        if self.sharded:
            self._shard()
        if compile_layers:
            for layer in self._decoder_layers():
                if share_prompts:  # the attention reads the prompts' cache: compiled around it
                    compile_around_attention(layer)
                else:
                    compile_like_eager(layer)
        self.model.train()
        # the sampled tokens' log-probs as the native engine's batch_invariant mode computes them
        self.invariant = None
        if batch_invariant:
            from loongsage.core.trainer.invariant import InvariantForward

            self.invariant = InvariantForward(self.model, fp32_lm_head)
        # under LoRA the base weights never change: the model with its adapters off is the reference
        self.reference: Callable[[], AbstractContextManager[None]] | None = (
            None if lora is None else lambda: adapters_disabled(self.model)
        )

    def _load(self, model_path: str, dtype: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])

    def _decoder_layers(self) -> list[torch.nn.Module]:
        return list(self.model.model.layers)

    def _add_lora(self, lora: LoraConfig, gradient_checkpointing: bool) -> None:
        """Adapters on the decoder's linear layers; only they train (see :mod:`.lora`)."""
        add_adapters(self.model, lora, self._decoder_layers())
        if gradient_checkpointing:
            # with reentrant checkpointing (older transformers' default) frozen embeddings would feed the
            # checkpointed layers inputs without grad, and the adapters inside them would get none
            self.model.enable_input_require_grads()
        if world_size() > 1:
            # ranks seed differently, so their random lora_A inits differ: start every replica at rank 0's
            for p in self.model.parameters():
                if p.requires_grad:
                    dist.broadcast(p.data, src=0)

    def _shard(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for layer in self._decoder_layers():
            fully_shard(layer)
        fully_shard(self.model)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # sum, not mean: see the module docstring
                # plain SUM collectives (gloo has no pre-multiplied sum); a factor of 1 needs no scaling
                module.set_force_sum_reduction_for_comms(True)

    @property
    def data_parallel(self) -> tuple[int, int, bool]:
        """Every rank is a data-parallel rank of its own."""
        return self.rank, world_size(), True

    # ------------------------------------------------------------------ forward
    def logits(self, input_ids: Tensor, attention_mask: Tensor, first: int = 1) -> Tensor:
        return policy_logits(self.model, input_ids, attention_mask, first, fp32_lm_head=self.fp32_lm_head)

    def forwarding(self, mb: TrainBatch) -> AbstractContextManager[None]:
        return nullcontext()

    def sequence_logprobs(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        if self.invariant is not None:
            return self.invariant.logprobs(ids, first, with_entropy=with_entropy)
        groups = self._shared_prompts(mb)
        if groups is not None:
            return self._shared_logprobs(ids, groups, first, with_entropy=with_entropy)
        if self.head_chunk_tokens:
            mask = mb.attention_mask.to(self.device)
            return chunked_logprobs_and_entropy(
                self.model, ids, mask, first, self.head_chunk_tokens, with_entropy=with_entropy
            )
        logits = self.logits(ids, mb.attention_mask.to(self.device), first)
        return logprobs_and_entropy(logits, ids, first, with_entropy=with_entropy)

    def _shared_prompts(self, mb: TrainBatch) -> PromptGroups | None:
        """The rows' prompt groups when computing each prompt once is the cheaper forward, else None."""
        if not self.shares_prompts:
            return None
        groups = shared_groups(mb, PASS_OVERHEAD_TOKENS)
        if groups is not None and torch.is_grad_enabled():
            self.shared_prompt_tokens += groups.repeated_prompt_tokens()
        return groups

    def _shared_logprobs(
        self, ids: Tensor, groups: PromptGroups, first: int, *, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`sequence_logprobs` by the two passes; each row's columns before its own first
        trained token (its prompt, where it is longer than another row's) are zeros."""
        hidden = shared_prompt_hidden(self.model.model, ids, groups)
        if self.head_chunk_tokens:
            lp, ent = chunked_head_logprobs(
                self.model, hidden, ids, first, self.head_chunk_tokens, with_entropy=with_entropy
            )
        else:
            logits = head_logits(self.model, hidden, first, fp32_lm_head=self.fp32_lm_head)
            lp, ent = logprobs_and_entropy(logits, ids, first, with_entropy=with_entropy)
        trained = trained_columns(groups, ids.shape[1], ids.device)
        return lp.where(trained, 0.0), None if ent is None else ent.where(trained, 0.0)

    def sequence_distribution(self, mb: TrainBatch, *, shards: bool) -> tuple[Tensor, Tensor, Tensor]:
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        groups = self._shared_prompts(mb)
        if groups is None:
            logits = self.logits(ids, mb.attention_mask.to(self.device), first)
            return logprobs_entropy_and_distribution(logits, ids, first, mb.teacher_dist_ids)
        hidden = shared_prompt_hidden(self.model.model, ids, groups)
        logits = head_logits(self.model, hidden, first, fp32_lm_head=self.fp32_lm_head)
        lp, ent, dist = logprobs_entropy_and_distribution(logits, ids, first, mb.teacher_dist_ids)
        trained = trained_columns(groups, ids.shape[1], ids.device)
        return lp.where(trained, 0.0), ent.where(trained, 0.0), dist.where(trained[:, first:, None], 0.0)

    def filler_logits(self) -> Tensor:
        filler = filler_input(self.device)
        return self.logits(filler, torch.ones_like(filler))

    def run_micro_batches(self, plans: list[Planned], step: MicroBatchStep, *, backward: bool) -> None:
        run_in_order(plans, step, backward=backward)

    @contextmanager
    def stepping(self, metrics: Metrics) -> Iterator[None]:
        """Counts the prompt tokens the step's forwards did not compute again (``share_prompts``)."""
        self.shared_prompt_tokens = 0
        yield
        if self.shares_prompts:
            metrics.total("train/shared_prompt_tokens", float(self.shared_prompt_tokens))

    def run_ahead(self, plans: list[Planned]) -> None:
        """Nothing: the model is in one piece, its whole forward runs in the step."""

    def ahead_input(self) -> AbstractContextManager[None]:
        return nullcontext()

    # ------------------------------------------------------------------ gradients
    def optimizer_buckets(self, params: list[torch.nn.Parameter]) -> list[tuple[list[torch.nn.Parameter], Any]]:
        return [(params, None)]  # every rank holds every parameter (or, under FSDP2, its shard of each)

    def sum_replica_grads(self, grad_of: Callable[[torch.nn.Parameter], Tensor | None]) -> None:
        """Nothing: a replica is one rank."""

    def clip_grad_norm(self, params: list[Tensor], max_norm: float, dist_opt: Any) -> Tensor:
        norm = (
            dist_opt.clip_grad_norm(max_norm)
            if dist_opt is not None
            else torch.nn.utils.clip_grad_norm_(params, max_norm)
        )
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: the norm is a DTensor

    # ------------------------------------------------------------------ weights and state
    def _full_state(self) -> dict[str, Tensor]:
        """Unsharded HF-named tensors; a collective under FSDP2 (every rank calls, rank 0 receives)."""
        if not self.sharded:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def checkpoint_state(self) -> dict[str, Tensor]:
        # under LoRA the base weights are the model_path checkpoint's: only the adapters are state
        return adapter_state(self.model) if self.lora is not None else self._full_state()

    def load_checkpoint_state(self, state: dict[str, Tensor]) -> None:
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
        elif self.lora is not None:
            load_adapter_state(self.model, state)
        else:
            self.model.load_state_dict(state)

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Under LoRA only the adapted weights, merged (``W + B @ A * scale``): every other tensor is
        still the base checkpoint the engine loaded, so sending it again would move bytes, not weights."""
        if self.lora is not None:
            yield from merged_weights(self.model)
            return
        if not self.sharded:  # the live tensors, listed every step: without state_dict()'s per-call work
            yield from state_tensors(self.model)
            return
        yield from self._full_state().items()

    def hf_state(self) -> dict[str, Tensor]:
        return merged_state(self.model) if self.lora is not None else self._full_state()

    def write_hf(self, path: Path, state: dict[str, Tensor]) -> None:
        self.model.save_pretrained(path, state_dict=state)
