"""The embedded torch trainer backend: an HF causal LM trained in place with AdamW.

The backend owns the model, the optimizer and the mechanics of a step (micro-batching by token
budget, gradient accumulation, clipping, data-parallel gradient reduction). What the loss *is*
comes from outside as a closure (:mod:`loongsage.core.loss`), so another backend (Megatron-Core)
implements the same small surface.

Data parallelism (``world_size > 1``, over a gloo process group on CPU or NCCL on GPU):
``dp_mode="fsdp2"`` shards every decoder layer and the root with FSDP2; ``"replicate"`` keeps a full
replica per rank and all-reduces a flat gradient buffer. Either way gradients are SUMMED across
ranks: the loss weights already carry the global denominators, so the sum is exactly the full-batch
gradient (FSDP2's default divide-by-world is switched off). FSDP2's forward and backward are
collectives, so every rank runs the same number of micro-batches: ranks with fewer pad with
zero-weight passes.

A row with several segments (a multi-turn trajectory whose history was rewritten) is split in the
forward into one sequence per segment, its outputs put back in the row (:mod:`loongsage.core.segments`).

A bfloat16 or float16 model trains on float32 master weights (:mod:`.master_weights`): the
optimizer steps float32 copies, and the micro-batches' gradients are summed in float32.

Checkpoints hold full (unsharded) state written by rank 0, so a run can resume under another DP
size or mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from loongsage.core.contracts import LossFunction, Trainer
from loongsage.core.embedded.logprobs import (
    logprobs_and_entropy,
    logprobs_entropy_and_distribution,
    policy_logits,
    response_start,
)
from loongsage.core.embedded.lora import (
    LoraConfig,
    adapter_state,
    adapters_disabled,
    add_adapters,
    check_targets,
    load_adapter_state,
    merged_state,
    merged_weights,
)
from loongsage.core.embedded.distributed_optimizer import DistributedOptimizer
from loongsage.core.embedded.master_weights import MasterWeights
from loongsage.core.embedded.held_teachers import HeldTeachers
from loongsage.core.embedded.micro_batching import planned_micro_batches
from loongsage.core.embedded.offload import place_trainer_state
from loongsage.core.embedded.state import rng_state, set_rng_state, state_tensors, sum_in_place
from loongsage.core.metrics import Metrics
from loongsage.core.segments import segment_layout
from loongsage.core.types import TrainBatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# loss_fn(logprobs [B, T], micro_batch) -> (weighted loss sum, Metrics): a contracts.LossFunction,
# or a bare callable. A LossFunction whose ``needs_student_distribution`` is true (MOPD's distribution
# divergences) is called with the keyword ``student_dist`` as well: see
# :func:`logprobs_entropy_and_distribution`.
LossFn = LossFunction | Callable[..., tuple[Tensor, Metrics]]


@dataclass
class TorchTrainer(Trainer):
    """HF transformers causal LM, fp32 on CPU, AdamW, grad clipping, FSDP2 or replicated DP
    (the :class:`~loongsage.core.contracts.Trainer` contract)."""

    kind = "trainer"

    model_path: str
    dtype: str = "float32"
    device: str = "cpu"
    fp32_lm_head: bool = True
    gradient_checkpointing: bool = False
    # a bfloat16/float16 model: the optimizer steps float32 copies, gradients sum in float32
    # (master_weights.py); not under FSDP2, whose shards stay in the model's dtype
    master_weights: bool = True
    # AdamW's float32 masters and moments split over the data-parallel ranks (ZeRO-1; with
    # dp_mode: replicate): distributed_optimizer.py
    distributed_optimizer: bool = False
    dp_mode: Literal["fsdp2", "replicate"] = "fsdp2"
    lora: LoraConfig | None = None  # None: full fine-tuning
    # micro-batches of rows of similar length when that saves padding (see micro_batching.py)
    group_by_length: bool = True

    supports_lora: ClassVar[bool] = True  # the critic's value head is outside the decoder layers LoRA targets

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {', '.join(_DTYPES)}")
        self.model = self._load_model()
        if self.lora is not None:
            self._add_lora()
        self.model.to(self.device)
        if self.gradient_checkpointing:
            self._enable_gradient_checkpointing()
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.sharded = self.world_size > 1 and self.dp_mode == "fsdp2"
        if self.sharded and self.distributed_optimizer:
            raise ValueError("distributed_optimizer: FSDP2 shards the optimizer state already; set dp_mode: replicate "
                             "to split it over the ranks this way, or leave distributed_optimizer false")
        if self.sharded:
            self._shard()
        self.model.train()
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.masters: MasterWeights | None = None
        self.dist_opt: DistributedOptimizer | None = None
        self.grad_clip = 1.0
        self.steps = 0
        self.teachers = HeldTeachers()
        # set for a step whose divergence sums over vocabulary shards (a backend splitting the vocabulary)
        self._vocab_sum: Callable[[Tensor], Tensor] | None = None

    @classmethod
    def preflight(cls, params: dict[str, Any], model_path: str, *, world_size: int = 1) -> None:
        """Checks that need the model, run by the controller before any actor starts (one line each).

        The model is instantiated on the meta device: its layer names without its weights.
        """
        lora = params.get("lora")
        if lora is None:
            return
        cls._check_lora_placement(world_size, params.get("dp_mode", "fsdp2"))
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        check_targets(lora, list(model.model.layers))

    @classmethod
    def _check_lora_placement(cls, world_size: int, dp_mode: str) -> None:
        if not cls.supports_lora:
            raise ValueError(f"lora: {cls.__name__} does not support LoRA; leave lora unset")
        if world_size > 1 and dp_mode == "fsdp2":
            raise ValueError("lora: dp_mode='fsdp2' is not supported with LoRA; set dp_mode='replicate' "
                             "(the adapters are small, so a full replica per rank costs little)")

    def _load_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_DTYPES[self.dtype])

    def _add_lora(self) -> None:
        """Adapters on the decoder's linear layers; only they train (see :mod:`.lora`)."""
        self._check_lora_placement(self.world_size, self.dp_mode)
        add_adapters(self.model, self.lora, self._decoder_layers())
        if self.gradient_checkpointing:
            # with reentrant checkpointing (older transformers' default) frozen embeddings would feed the
            # checkpointed layers inputs without grad, and the adapters inside them would get none
            self.model.enable_input_require_grads()
        if self.world_size > 1:
            # ranks seed differently, so their random lora_A inits differ: start every replica at rank 0's
            for p in self.model.parameters():
                if p.requires_grad:
                    dist.broadcast(p.data, src=0)

    def _enable_gradient_checkpointing(self) -> None:
        self.model.gradient_checkpointing_enable()

    def _decoder_layers(self) -> list[torch.nn.Module]:
        return list(self.model.model.layers)

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

    # ------------------------------------------------------------------ setup
    def setup_optimizer(self, lr: float, betas: list[float], eps: float, weight_decay: float,
                        grad_clip: float, warmup_steps: int = 0) -> None:
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # the adapters only, under LoRA
        if self.distributed_optimizer:
            self.dist_opt = DistributedOptimizer(self._optimizer_buckets(trainable), lr=lr, betas=tuple(betas), eps=eps,
                                                 weight_decay=weight_decay)
            self.optimizer = self.dist_opt.optimizer
        elif self.master_weights and not self.sharded and any(p.dtype != torch.float32 for p in trainable):
            self.masters = MasterWeights(trainable)
            trainable = self.masters.masters
        if self.dist_opt is None:
            self.optimizer = torch.optim.AdamW(trainable, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        warm = max(1, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))
        self.grad_clip = grad_clip

    def _optimizer_buckets(self, params: list[torch.nn.Parameter]) -> list[tuple[list[torch.nn.Parameter], Any]]:
        """The distributed optimizer's buckets: parameters and the group of ranks holding them alike."""
        return [(params, None)]

    @property
    def holds_reference(self) -> bool:
        """Under LoRA the frozen base IS the starting policy: :meth:`reference_logprobs` answers."""
        return self.lora is not None

    @property
    def data_parallel(self) -> tuple[int, int, bool]:
        """``(data-parallel rank, data-parallel size, leader)``: every rank is a data-parallel rank of
        its own here (a backend with model parallelism groups ranks that see the same rows)."""
        return self.rank, self.world_size, True

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    # ------------------------------------------------------------------ forward
    def _logits(self, input_ids: Tensor, attention_mask: Tensor, first: int = 1) -> Tensor:
        return policy_logits(self.model, input_ids, attention_mask, first, fp32_lm_head=self.fp32_lm_head)

    def _forward(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Per-token outputs ``[b, t]`` of a micro-batch, each segment of a row scored as a sequence
        of its own (:mod:`loongsage.core.segments`); a batch without split rows in one plain pass."""
        layout = segment_layout(mb)
        if layout is None:
            return self._forward_sequences(mb, with_entropy=with_entropy)
        out, ent = self._forward_sequences(layout.split_batch(mb), with_entropy=with_entropy)
        t = mb.input_ids.shape[1]
        return layout.merge(out, t), None if ent is None else layout.merge(ent, t)

    def _forward_sequences(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) of rows that are whole sequences."""
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        logits = self._logits(ids, mb.attention_mask.to(self.device), first)
        return logprobs_and_entropy(logits, ids, first, with_entropy=with_entropy)

    def _forward_distribution(self, mb: TrainBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Log-probs, entropies and the student's log-probs on the teacher's support (MOPD), each
        segment scored alone as in :meth:`_forward`; the support's log-probs cover positions from
        the micro-batch's first trained token on."""
        layout = segment_layout(mb)
        if layout is None:
            return self._distribution_sequences(mb)
        lp, ent, dist = self._distribution_sequences(layout.split_batch(mb))
        t, width = mb.input_ids.shape[1], layout.width
        first, out_first = width - dist.shape[1], max(response_start(mb.response_mask), 1)
        return (layout.merge(lp, t), layout.merge(ent, t),
                layout.merge(dist, t, first=first, out_first=out_first))

    def _distribution_sequences(self, mb: TrainBatch) -> tuple[Tensor, Tensor, Tensor]:
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        logits = self._logits(ids, mb.attention_mask.to(self.device), first)
        return logprobs_entropy_and_distribution(logits, ids, first, mb.teacher_dist_ids)

    def _aligned(self, batch: TrainBatch, token_budget: int) -> list[tuple[list[int], TrainBatch] | None]:
        """``(rows, micro-batch)`` pairs, padded with ``None`` to the largest count over ranks (FSDP2
        collectives)."""
        mbs: list[tuple[list[int], TrainBatch] | None] = (
            list(planned_micro_batches(batch, token_budget, group_by_length=self.group_by_length)) if len(batch) else [])
        if self.world_size > 1:
            count = torch.tensor([len(mbs)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            mbs += [None] * (int(count) - len(mbs))
        return mbs

    def _filler(self) -> Tensor:
        """A two-token input for a rank's zero-weight padding pass."""
        return torch.zeros(1, 2, dtype=torch.long, device=self.device)

    def _run_micro_batches(self, plans: list[tuple[list[int], TrainBatch] | None],
                           step: Callable[[tuple[list[int], TrainBatch] | None], Tensor | None], *,
                           backward: bool) -> None:
        """Run ``step`` on each planned micro-batch in order (``None``: a zero-weight padding pass),
        with ``backward`` from the loss it returns. A backend that splits the model into pipeline
        stages runs them in its own schedule instead."""
        for planned in plans:
            out = step(planned)
            if backward:
                out.backward()

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, token_budget: int) -> tuple[Tensor, Tensor]:
        """Per-token log-probs and entropies of ``batch`` under the current weights (no grad)."""
        self.model.eval()
        B, T = batch.input_ids.shape
        out_lp = torch.zeros(B, T)
        out_ent = torch.zeros(B, T)

        def score(planned: tuple[list[int], TrainBatch] | None) -> None:
            if planned is None:
                filler = self._filler()
                self._logits(filler, torch.ones_like(filler))
                return
            rows, mb = planned
            lp, ent = self._forward(mb, with_entropy=True)
            t = lp.shape[1]
            index = torch.tensor(rows)
            out_lp[index, :t] = lp.cpu()
            if ent is not None:
                out_ent[index, :t] = ent.cpu()

        self._run_micro_batches(self._aligned(batch, token_budget), score, backward=False)
        self.model.train()
        return out_lp, out_ent

    def reference_logprobs(self, batch: TrainBatch, token_budget: int) -> Tensor | None:
        """Log-probs of the frozen starting policy when this trainer holds it already, else None.

        Under LoRA the base weights never change, so the model with its adapters switched off is
        the reference: no second model in memory.
        """
        if self.lora is None:
            return None
        with adapters_disabled(self.model):
            return self.logprobs(batch, token_budget)[0]

    # ------------------------------------------------------------------ held teachers (MOPD)
    def add_teacher(self, sources: list[str], model_path: str) -> None:
        """Hold the MOPD teacher of ``sources`` (``teacher: {name: trainer}``): a frozen copy of this
        backend built from ``model_path``, split over the ranks as the policy is (see
        :mod:`.held_teachers`). Every rank calls, in the same order."""
        teacher = replace(self, model_path=model_path, **self._teacher_overrides())
        teacher.model.eval().requires_grad_(False)
        self.teachers.add(sources, teacher)

    def _teacher_overrides(self) -> dict[str, Any]:
        """What a held teacher does not take from the policy: adapters, recomputation."""
        return {"lora": None, "gradient_checkpointing": False}

    def teacher_logprobs(self, batch: TrainBatch, token_budget: int) -> Tensor:
        """The held teachers' log-probs of ``batch``'s tokens, each row by its source's teacher."""
        return self.teachers.logprobs(batch, token_budget)

    def _teacher_support(self, loss_fn: LossFn) -> int | None:
        """``k`` (0: the full vocabulary) when held teachers must give this loss their distribution
        in the train step, else None."""
        if not self.teachers or not (isinstance(loss_fn, LossFunction) and loss_fn.needs_student_distribution):
            return None
        return loss_fn.teacher_request()[0]

    def _teachers_ahead(self, plans: list[tuple[list[int], TrainBatch] | None]) -> None:
        """Work the held teachers do on the step's micro-batches before the student's pass (none
        here; pipeline stages run theirs ahead)."""

    def teacher_distribution(self, mb: TrainBatch) -> Tensor:
        """As a held teacher: the log-softmax of a micro-batch's rows from its first trained position
        on, ``[n, t - first, V]`` (no gradient)."""
        with torch.no_grad():
            return self._forward_distribution(mb)[2]

    def teacher_filler(self) -> None:
        """As a held teacher: a filler forward, for a micro-batch without rows of its sources."""
        with torch.no_grad():
            filler = self._filler()
            self._logits(filler, torch.ones_like(filler))

    # ------------------------------------------------------------------ training
    def train_step(self, mini_batch: TrainBatch, loss_fn: LossFn, token_budget: int) -> Metrics:
        """One optimizer step over ``mini_batch``; ``loss_fn`` returns the weighted loss *sum*.

        The loss of every micro-batch is already scaled by global denominators, so gradients are
        accumulated by plain summation and summed across data-parallel ranks. Every rank must call
        this once per optimizer step, with an empty batch if it has no rows. Returns the loss's
        metrics summed over micro-batches, ``train/entropy``, the total ``train/loss`` and the
        gauges ``train/grad_norm`` and ``train/lr``.
        """
        assert self.optimizer is not None, "setup_optimizer() first"
        self.optimizer.zero_grad(set_to_none=True)
        if self.dist_opt is not None:
            self.dist_opt.zero_grad()
        metrics = Metrics().total("train/loss", 0.0)
        plans = self._aligned(mini_batch, token_budget)
        if self._teacher_support(loss_fn) is not None:
            self._teachers_ahead(plans)
        self._run_micro_batches(plans, lambda planned: self._micro_batch_loss(planned, loss_fn, metrics), backward=True)
        if self.dist_opt is not None:
            self._reduce_scatter_grads()
        elif self.world_size > 1 and not self.sharded:
            self._all_reduce_grads()
        grad_norm = self._clip_grad_norm()
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if self.dist_opt is not None:
            self.dist_opt.step()
        else:
            self.optimizer.step()
        if self.masters is not None:
            self.masters.to_model()
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        return metrics.gauge("train/grad_norm", float(grad_norm)).gauge("train/lr", self.optimizer.param_groups[0]["lr"])

    def _micro_batch_loss(self, planned: tuple[list[int], TrainBatch] | None, loss_fn: LossFn,
                          metrics: Metrics) -> Tensor:
        """One micro-batch's loss (a padding pass: zero times a forward), its metrics, entropy and
        ``train/loss`` added to ``metrics``."""
        topk = self._teacher_support(loss_fn)
        if planned is None:
            if topk is not None:
                self.teachers.support(None, topk, self.device, collective=self.world_size > 1)
            filler = self._filler()
            return self._logits(filler, torch.ones_like(filler)).sum() * 0.0
        mb = planned[1].to(self.device)  # the loss reads the batch beside the forward's outputs
        if topk is not None:  # this micro-batch's teacher distribution, computed here (held teachers)
            ids, dist = self.teachers.support(planned[1], topk, self.device, collective=self.world_size > 1)
            mb = replace(mb, teacher_dist_ids=ids, teacher_dist_logprobs=dist)
        if isinstance(loss_fn, LossFunction) and loss_fn.needs_student_distribution:
            lp, ent, dist = self._forward_distribution(mb)
            shards = {} if self._vocab_sum is None else {"vocab_sum": self._vocab_sum}
            loss, mb_metrics = loss_fn(lp, mb, student_dist=dist, **shards)
        else:
            lp, ent = self._forward(mb, with_entropy=True)
            loss, mb_metrics = loss_fn(lp, mb)
        metrics.merge(mb_metrics).total("train/loss", float(loss.detach()))
        if ent is not None:
            mask = mb.response_mask.to(ent.device)
            metrics.add("train/entropy", float((ent * mask).sum()), float(mask.sum()))
        return loss

    def _trained(self) -> list[Tensor]:
        """What the optimizer steps, holding the step's gradients: the trainable parameters, or
        their float32 masters."""
        return list(self.optimizer.param_groups[0]["params"]) if self.optimizer is not None else []

    def _grad(self, param: torch.nn.Parameter) -> Tensor | None:
        """``param``'s gradient of the step so far, wherever it is held: in the distributed
        optimizer's flat vector (before its reduction), on its float32 master, or on itself."""
        if self.dist_opt is not None:
            return self.dist_opt.grad_view(param)
        return (param if self.masters is None else self.masters.holder(param)).grad

    def _clip_grad_norm(self) -> Tensor:
        """Clip the gradients to ``grad_clip`` by their global norm; returns the norm before."""
        if self.dist_opt is not None:
            return self.dist_opt.clip_grad_norm(self.grad_clip)
        return torch.nn.utils.clip_grad_norm_(self._trained(), self.grad_clip)

    def _reduce_scatter_grads(self) -> None:
        """The distributed optimizer's reduction: each rank keeps the summed gradient of its slice."""
        self.dist_opt.reduce_scatter()

    def _optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state for a checkpoint (with the distributed optimizer a collective:
        every rank calls)."""
        return self.dist_opt.state_dict() if self.dist_opt is not None else self.optimizer.state_dict()

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self.dist_opt is not None:
            self.dist_opt.load_state_dict(state)
        else:
            self.optimizer.load_state_dict(state)

    def _all_reduce_grads(self, group: Any = None) -> None:
        """Sum the gradients over the data-parallel ranks (``group``: all ranks when None)."""
        params = self._trained()
        for p in params:
            if p.grad is None:  # a rank whose batch never touched this parameter still joins the sum
                p.grad = torch.zeros_like(p)
        sum_in_place([p.grad for p in params], group)

    # ------------------------------------------------------------------ weights and state
    def _full_model_state(self) -> dict[str, Tensor]:
        """Unsharded HF-named tensors; a collective under FSDP2 (every rank calls, rank 0 receives)."""
        if not self.sharded:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors of the current policy (what an engine loads). Call on every rank.

        Under LoRA only the adapted weights, merged (``W + B @ A * scale``): every other tensor is
        still the base checkpoint the engine loaded, so sending it again would move bytes, not weights.
        """
        if self.lora is not None:
            yield from merged_weights(self.model)
            return
        if not self.sharded:  # the live tensors, listed every step: without state_dict()'s per-call work
            yield from state_tensors(self.model)
            return
        yield from self._full_model_state().items()

    def save(self, path: str | Path) -> None:
        """Full state by rank 0 (``trainer.pt``) plus every rank's RNG. Call on every rank."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        # under LoRA the base weights are the model_path checkpoint's: only the adapters are state
        model_state = adapter_state(self.model) if self.lora is not None else self._full_model_state()
        optim_state = None
        if self.optimizer is not None and self._optimizer_in_trainer_file:
            optim_state = self._optimizer_state()
            if self.sharded:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

                optim_state = get_optimizer_state_dict(
                    self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            torch.save({
                "model": model_state, "optimizer": optim_state,
                "master_weights": self.masters.state() if optim_state is not None and self.masters is not None else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None, "steps": self.steps,
            }, path / "trainer.pt")
        torch.save(rng_state(), path / f"rng_rank{self.rank}.pt")

    @property
    def _optimizer_in_trainer_file(self) -> bool:
        """Whether ``trainer.pt`` holds the optimizer's state and the float32 masters (every rank
        holds the same parameters); a backend whose ranks hold different shards saves each
        shard's beside it instead."""
        return True

    def load(self, path: str | Path) -> None:
        path = Path(path)
        state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, state["model"], options=options)
            if self.optimizer is not None and state["optimizer"] is not None:
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        elif self.lora is not None:
            load_adapter_state(self.model, state["model"])
            if self.optimizer is not None and state["optimizer"] is not None:
                self._load_optimizer_state(state["optimizer"])
        else:
            self._load_model_state(state["model"])
            if self.optimizer is not None and state["optimizer"] is not None:
                self._load_optimizer_state(state["optimizer"])
        if self.masters is not None:  # a checkpoint without them: the loaded weights
            self.masters.load(state.get("master_weights"))
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))

    def _load_model_state(self, state: dict[str, Tensor]) -> None:
        """The model's weights from the HF-named tensors that :meth:`save` wrote."""
        self.model.load_state_dict(state)

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> None:
        """Write an HF folder (rank 0). Call on every rank: gathering shards is a collective."""
        state = merged_state(self.model) if self.lora is not None else self._full_model_state()
        if self.rank == 0:
            self._write_hf(Path(path), state)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)

    def _write_hf(self, path: Path, state: dict[str, Tensor]) -> None:
        self.model.save_pretrained(path, state_dict=state)

    def param_checksum(self) -> float:
        """Sum of |w| over this rank's parameters (its shards under FSDP2)."""
        return float(sum(p.detach().double().abs().sum() for p in self.model.parameters()))

    def offload(self, weights: bool = True) -> None:
        """Free the device for a colocated engine: AdamW's moments, the float32 masters and
        (unless ``weights`` is False: a weight push still reads them) the model's weights move to
        host memory, and the last step's gradients are dropped (a step starts from none). Nothing
        moves when the trainer runs on the CPU."""
        self._place("cpu", weights=weights)

    def onload(self) -> None:
        """Everything :meth:`offload` moved, back on the trainer's device."""
        self._place(self.device, weights=True)

    def _place(self, device: str, *, weights: bool) -> None:
        if not str(self.device).startswith("cuda"):
            return
        if self.sharded:
            raise ValueError("offload: an FSDP2-sharded trainer cannot move its shards to host memory yet; allowed: "
                             "placement.offload_trainer=false, or dp_mode: replicate")
        place_trainer_state(self.model, self.optimizer, self.masters, self.dist_opt, device, weights=weights)
        for teacher in self.teachers.models():  # no step reads them before the next train phase
            teacher._place(device, weights=True)
