"""The trainer skeleton: the mechanics of a train step that do not depend on how the model is built
or split over the ranks. A trainer backend is this skeleton driving one model adapter
(:class:`~loongsage.core.trainer.adapter.ModelAdapter`); the torch and the Megatron trainers are two
such pairs, and neither sees the other.

What the skeleton does, on every backend alike:

* **Micro-batches** by token budget (:mod:`.micro_batching`), grouped by length where that saves
  padding; the model's forward is a collective when it is split, so every rank runs as many as the
  busiest and pads with zero-weight filler passes.
* **Segments**: a row with several segments (a multi-turn trajectory whose history was rewritten)
  is split in the forward into one sequence per segment and put back (:mod:`loongsage.core.segments`).
* **The loss** is a closure from outside (:mod:`loongsage.core.loss`), called per micro-batch with
  the forward's log-probs; it is already scaled by the step's global denominators, so gradients
  accumulate by plain summation and are SUMMED across data-parallel ranks: the full-batch gradient.
* **The optimizer**: AdamW with warm-up and clipping; float32 master weights for a bfloat16 or
  float16 model (:mod:`.master_weights`), or the distributed optimizer splitting masters and
  moments over the data-parallel ranks (:mod:`.distributed_optimizer`).
* **Held MOPD teachers** (:mod:`.held_teachers`): frozen copies of the same backend whose
  distribution each micro-batch's loss reads, computed beside the student's forward.
* **Checkpoints** of full (unsharded) HF-named state written by rank 0, so a run can resume under
  another data-parallel layout; exports to the engines and to an HF folder; offload to host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from loongsage.core.contracts import LossFunction, Trainer
from loongsage.core.metrics import Metrics
from loongsage.core.model_math.dtypes import DTYPES
from loongsage.core.model_math.logprobs import response_start
from loongsage.core.model_math.state import group_size, rng_state, set_rng_state, sum_in_place
from loongsage.core.segments import segment_layout
from loongsage.core.trainer.adapter import ModelAdapter, Planned, VocabSplit, world_size
from loongsage.core.trainer.distributed_optimizer import DistributedOptimizer
from loongsage.core.trainer.held_teachers import HeldTeachers
from loongsage.core.trainer.master_weights import MasterWeights
from loongsage.core.trainer.micro_batching import planned_micro_batches
from loongsage.core.trainer.offload import place_trainer_state
from loongsage.core.types import TrainBatch

# loss_fn(logprobs [B, T], micro_batch) -> (weighted loss sum, Metrics): a contracts.LossFunction,
# or a bare callable. A LossFunction whose ``needs_student_distribution`` is true (MOPD's distribution
# divergences) is called with the keyword ``student_dist`` as well: see
# :func:`~loongsage.core.model_math.logprobs.logprobs_entropy_and_distribution`.
LossFn = LossFunction | Callable[..., tuple[Tensor, Metrics]]


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")


@dataclass
class TrainerSkeleton(Trainer):
    """A trainer backend's step mechanics (see the module docstring) over the model adapter a
    subclass builds from its params in ``__post_init__`` and hands to :meth:`_attach`.

    The fields are the params every backend built on it takes; a subclass adds its own."""

    model_path: str
    dtype: str = "float32"
    device: str = "cpu"
    fp32_lm_head: bool = True
    gradient_checkpointing: bool = False
    # a bfloat16/float16 model: the optimizer steps float32 copies, gradients sum in float32
    # (master_weights.py); not where the data parallelism shards the parameters (FSDP2)
    master_weights: bool = True
    # AdamW's float32 masters and moments split over the data-parallel ranks (ZeRO-1):
    # distributed_optimizer.py
    distributed_optimizer: bool = False
    # micro-batches of rows of similar length when that saves padding (see micro_batching.py)
    group_by_length: bool = True

    # what a held teacher (a frozen copy of the trainer, :meth:`add_teacher`) does not take from the
    # policy's params
    held_teacher_params: ClassVar[dict[str, Any]] = {"gradient_checkpointing": False}

    def _attach(self, adapter: ModelAdapter) -> None:
        """Start training ``adapter``'s model: no optimizer until :meth:`setup_optimizer`."""
        self.adapter = adapter
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.masters: MasterWeights | None = None
        self.dist_opt: DistributedOptimizer | None = None
        self.grad_clip = 1.0
        self.steps = 0
        self.teachers = HeldTeachers()
        # set for a step whose divergence sums over the vocabulary's shards (the model splits it)
        self._vocab_split: VocabSplit | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.adapter.model

    @property
    def world_size(self) -> int:
        return world_size()

    @property
    def data_parallel(self) -> tuple[int, int, bool]:
        return self.adapter.data_parallel

    @property
    def holds_reference(self) -> bool:
        """The model can be the frozen starting policy (LoRA: the base): :meth:`reference_logprobs` answers."""
        return self.adapter.reference is not None

    # ------------------------------------------------------------------ setup
    def setup_optimizer(
        self, lr: float, betas: list[float], eps: float, weight_decay: float, grad_clip: float, warmup_steps: int = 0
    ) -> None:
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # the adapters only, under LoRA
        if self.distributed_optimizer:
            self.dist_opt = DistributedOptimizer(
                self.adapter.optimizer_buckets(trainable), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay
            )
            self.optimizer = self.dist_opt.optimizer
        elif self.master_weights and not self.adapter.sharded and any(p.dtype != torch.float32 for p in trainable):
            self.masters = MasterWeights(trainable)
            trainable = self.masters.masters
        if self.dist_opt is None:
            # On CUDA one fused kernel steps every tensor (the multi-tensor loop launches a pass per
            # operation); on the CPU the reference implementation keeps runs reproducible bit for bit.
            fused = all(p.is_cuda and type(p) is torch.nn.Parameter for p in trainable) or None
            self.optimizer = torch.optim.AdamW(
                trainable, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=fused
            )
        warm = max(1, warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warm))
        self.grad_clip = grad_clip

    # ------------------------------------------------------------------ forward
    def _aligned(self, batch: TrainBatch, token_budget: int) -> list[Planned]:
        """The planned micro-batches, padded with ``None`` to the largest count over ranks (a split
        model's forward is a collective)."""
        mbs: list[Planned] = (
            list(
                planned_micro_batches(
                    batch,
                    token_budget,
                    group_by_length=self.group_by_length,
                    share_prompts=self.adapter.shares_prompts,
                )
            )
            if len(batch)
            else []
        )
        if self.world_size > 1:
            count = torch.tensor([len(mbs)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            mbs += [None] * (int(count) - len(mbs))
        return mbs

    def _forward(self, mb: TrainBatch, *, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Per-token outputs ``[b, t]`` of a micro-batch, each segment of a row scored as a sequence
        of its own (:mod:`loongsage.core.segments`); a batch without split rows in one plain pass."""
        with self.adapter.forwarding(mb):
            layout = segment_layout(mb)
            if layout is None:
                return self.adapter.sequence_logprobs(mb, with_entropy=with_entropy)
            out, ent = self.adapter.sequence_logprobs(layout.split_batch(mb), with_entropy=with_entropy)
            t = mb.input_ids.shape[1]
            return layout.merge(out, t), None if ent is None else layout.merge(ent, t)

    def _forward_distribution(self, mb: TrainBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Log-probs, entropies and the student's log-probs on the teacher's support (MOPD), each
        segment scored alone as in :meth:`_forward`; the support's log-probs cover positions from
        the micro-batch's first trained token on."""
        shards = self._vocab_split is not None
        with self.adapter.forwarding(mb):
            layout = segment_layout(mb)
            if layout is None:
                return self.adapter.sequence_distribution(mb, shards=shards)
            lp, ent, dist_ = self.adapter.sequence_distribution(layout.split_batch(mb), shards=shards)
            t, width = mb.input_ids.shape[1], layout.width
            first, out_first = width - dist_.shape[1], max(response_start(mb.response_mask), 1)
            return (layout.merge(lp, t), layout.merge(ent, t), layout.merge(dist_, t, first=first, out_first=out_first))

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, token_budget: int) -> tuple[Tensor, Tensor]:
        """Per-token log-probs and entropies of ``batch`` under the current weights (no grad)."""
        self.model.eval()
        B, T = batch.input_ids.shape
        out_lp = torch.zeros(B, T)
        out_ent = torch.zeros(B, T)

        def score(planned: Planned) -> None:
            if planned is None:
                self.adapter.filler_logits()
                return
            rows, mb = planned
            lp, ent = self._forward(mb, with_entropy=True)
            t = lp.shape[1]
            index = torch.tensor(rows)
            out_lp[index, :t] = lp.cpu()
            if ent is not None:
                out_ent[index, :t] = ent.cpu()

        self.adapter.run_micro_batches(self._aligned(batch, token_budget), score, backward=False)
        self.model.train()
        return out_lp, out_ent

    def reference_logprobs(self, batch: TrainBatch, token_budget: int) -> Tensor | None:
        """Log-probs of the frozen starting policy when the model can be it (LoRA: the adapters off,
        the base weights never change), else None: no second model in memory."""
        if self.adapter.reference is None:
            return None
        with self.adapter.reference():
            return self.logprobs(batch, token_budget)[0]

    # ------------------------------------------------------------------ held teachers (MOPD)
    def add_teacher(self, sources: list[str], model_path: str) -> None:
        """Hold the MOPD teacher of ``sources`` (``teacher: {name: trainer}``): a frozen copy of this
        backend built from ``model_path``, split over the ranks as the policy is (see
        :mod:`.held_teachers`). Every rank calls, in the same order."""
        teacher = replace(self, model_path=model_path, **self.held_teacher_params)
        teacher.model.eval().requires_grad_(False)
        self.teachers.add(sources, teacher)

    def teacher_logprobs(self, batch: TrainBatch, token_budget: int) -> Tensor:
        """The held teachers' log-probs of ``batch``'s tokens, each row by its source's teacher."""
        return self.teachers.logprobs(batch, token_budget)

    def teacher_distribution(self, mb: TrainBatch) -> Tensor:
        """As a held teacher: the log-softmax of a micro-batch's rows from its first trained position
        on, ``[n, t - first, V]`` (no gradient)."""
        with self.adapter.ahead_input(), torch.no_grad():
            return self._forward_distribution(mb)[2]

    def teacher_filler(self) -> None:
        """As a held teacher: a filler forward, for a micro-batch without rows of its sources."""
        with self.adapter.ahead_input(), torch.no_grad():
            self.adapter.filler_logits()

    def _teacher_support(self, loss_fn: LossFn) -> int | None:
        """``k`` (0: the full vocabulary) when held teachers must give this loss their distribution
        in the train step, else None."""
        if not self.teachers or not (isinstance(loss_fn, LossFunction) and loss_fn.needs_student_distribution):
            return None
        return loss_fn.teacher_support[0]

    def _teachers_ahead(self, plans: list[Planned]) -> None:
        """Each held teacher's work on its rows of the step's micro-batches that runs before the
        student's pass (a pipeline's early stages)."""
        for sources, teacher in self.teachers.held:
            teacher.adapter.run_ahead(self.teachers.planned(plans, sources))

    # ------------------------------------------------------------------ training
    def train_step(self, mini_batch: TrainBatch, loss_fn: LossFn, token_budget: int) -> Metrics:
        """One optimizer step over ``mini_batch``; ``loss_fn`` returns the weighted loss *sum*.

        The loss of every micro-batch is already scaled by global denominators, so gradients are
        accumulated by plain summation and summed across data-parallel ranks. Every rank must call
        this once per optimizer step, with an empty batch if it has no rows. Returns the loss's
        metrics summed over micro-batches, ``train/entropy``, the total ``train/loss``, the gauges
        ``train/grad_norm`` and ``train/lr``, and the model's own totals (:meth:`ModelAdapter.stepping`).
        """
        split = self.adapter.vocab_split if isinstance(loss_fn, LossFunction) and loss_fn.reads_vocab_shards else None
        if split is not None:
            # the divergence sums over the vocabulary's shards: the student, its held teachers and a
            # teacher worker's whole distribution all come as this rank's shard
            for trainer in (self, *self.teachers.models()):
                trainer._vocab_split = split
            if mini_batch.teacher_dist_logprobs is not None:
                mini_batch = replace(mini_batch, teacher_dist_logprobs=split.own(mini_batch.teacher_dist_logprobs))
        metrics = Metrics().total("train/loss", 0.0)
        try:
            with self.adapter.stepping(metrics):
                self._step(mini_batch, loss_fn, token_budget, metrics)
        finally:
            for trainer in (self, *self.teachers.models()):
                trainer._vocab_split = None
        return metrics

    def _step(self, mini_batch: TrainBatch, loss_fn: LossFn, token_budget: int, metrics: Metrics) -> None:
        assert self.optimizer is not None, "setup_optimizer() first"
        self.optimizer.zero_grad(set_to_none=True)
        if self.dist_opt is not None:
            self.dist_opt.zero_grad()
        plans = self._aligned(mini_batch, token_budget)
        if self._teacher_support(loss_fn) is not None:
            self._teachers_ahead(plans)
        self.adapter.run_micro_batches(
            plans, lambda planned: self._micro_batch_loss(planned, loss_fn, metrics), backward=True
        )
        self._reduce_grads()
        grad_norm = self.adapter.clip_grad_norm(self._trained(), self.grad_clip, self.dist_opt)
        if self.dist_opt is not None:
            self.dist_opt.step()
        else:
            self.optimizer.step()
        if self.masters is not None:
            self.masters.to_model()
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        metrics.gauge("train/grad_norm", float(grad_norm)).gauge("train/lr", self.optimizer.param_groups[0]["lr"])

    def _micro_batch_loss(self, planned: Planned, loss_fn: LossFn, metrics: Metrics) -> Tensor:
        """One micro-batch's loss (a padding pass: zero times a forward), its metrics, entropy and
        ``train/loss`` added to ``metrics``."""
        topk = self._teacher_support(loss_fn)
        if planned is None:
            if topk is not None:
                self.teachers.support(None, topk, self.device, collective=self.world_size > 1)
            return self.adapter.filler_logits().sum() * 0.0
        mb = planned[1].to(self.device)  # the loss reads the batch beside the forward's outputs
        if topk is not None:  # this micro-batch's teacher distribution, computed here (held teachers)
            ids, dist_ = self.teachers.support(planned[1], topk, self.device, collective=self.world_size > 1)
            mb = replace(mb, teacher_dist_ids=ids, teacher_dist_logprobs=dist_)
        if isinstance(loss_fn, LossFunction) and loss_fn.needs_student_distribution:
            lp, ent, dist_ = self._forward_distribution(mb)
            shards = {} if self._vocab_split is None else {"vocab_sum": self._vocab_split.sum}
            loss, mb_metrics = loss_fn(lp, mb, student_dist=dist_, **shards)
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

    def _reduce_grads(self) -> None:
        """The step's gradients summed over the ranks that hold each parameter alike: within a split
        replica first, then over the data-parallel ranks (the distributed optimizer's reduce-scatter
        leaves each rank its slice). FSDP2's backward has reduced them already."""
        if self.dist_opt is not None:
            self.adapter.sum_replica_grads(self._grad)
            self.dist_opt.reduce_scatter()
        elif self.world_size > 1 and not self.adapter.sharded:
            self.adapter.sum_replica_grads(self._grad)
            params = self._trained()  # the float32 masters carry the parameters' marks
            for p in params:
                if p.grad is None:  # a rank whose batch never touched this parameter still joins the sum
                    p.grad = torch.zeros_like(p)
            for members, group in self.adapter.optimizer_buckets(params):
                if members and group_size(group) > 1:
                    sum_in_place([p.grad for p in members], group)

    # ------------------------------------------------------------------ weights and state
    def _optimizer_state(self) -> dict[str, Any]:
        """The optimizer's whole state for a checkpoint (a collective under the distributed
        optimizer and FSDP2: every rank calls)."""
        if self.dist_opt is not None:
            return self.dist_opt.state_dict()
        if self.adapter.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(
                self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        return self.optimizer.state_dict()

    def _load_optimizer_state(self, state: dict[str, Any]) -> None:
        if self.dist_opt is not None:
            self.dist_opt.load_state_dict(state)
        elif self.adapter.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(state)

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named tensors of the current policy (what an engine loads). Call on every rank."""
        return self.adapter.export_weights()

    def save(self, path: str | Path) -> None:
        """Full state by rank 0 (``trainer.pt``) plus every rank's RNG, and where the ranks hold
        different shards each shard's optimizer state beside it. Call on every rank."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        model_state = self.adapter.checkpoint_state()
        shard_file = self.adapter.optimizer_file
        optim_state = None
        if self.optimizer is not None and shard_file is None:
            optim_state = self._optimizer_state()
        if self.rank == 0:
            torch.save(
                {
                    "model": model_state,
                    "optimizer": optim_state,
                    "master_weights": self.masters.state()
                    if optim_state is not None and self.masters is not None
                    else None,
                    "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                    "steps": self.steps,
                },
                path / "trainer.pt",
            )
        torch.save(rng_state(), path / f"rng_rank{self.rank}.pt")
        if shard_file is not None and self.optimizer is not None:
            state = {
                "optimizer": self._optimizer_state(),  # a collective under the distributed optimizer
                "master_weights": self.masters.state() if self.masters is not None else None,
            }
            if shard_file.writes:
                torch.save(state, path / shard_file.name)

    def load(self, path: str | Path) -> None:
        path = Path(path)
        state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
        self.adapter.load_checkpoint_state(state["model"])
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
        shard_file = self.adapter.optimizer_file
        if shard_file is not None and self.optimizer is not None:
            saved = torch.load(path / shard_file.name, map_location="cpu", weights_only=False)
            self._load_optimizer_state(saved["optimizer"])
            if self.masters is not None:
                self.masters.load(saved["master_weights"])

    def export_hf(self, path: str | Path, tokenizer: Any = None) -> None:
        """Write an HF folder (rank 0). Call on every rank: gathering shards is a collective."""
        state = self.adapter.hf_state()
        if self.rank == 0:
            self.adapter.write_hf(Path(path), state)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)

    def param_checksum(self) -> float:
        """Sum of |w| over this rank's parameters (its shards where the model is split)."""
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
        if self.adapter.sharded:
            raise ValueError(
                "offload: an FSDP2-sharded trainer cannot move its shards to host memory yet; allowed: "
                "placement.offload_trainer=false, or dp_mode: replicate"
            )
        place_trainer_state(self.model, self.optimizer, self.masters, self.dist_opt, device, weights=weights)
        for teacher in self.teachers.models():  # no step reads them before the next train phase
            teacher._place(device, weights=True)
