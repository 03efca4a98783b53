"""The embedded teacher backend: a frozen HF causal LM that scores the student's tokens (MOPD).

Forward only, no optimizer, no gradient. Given a batch of the student's trajectories (token ids,
attention and response masks) it returns, per response position, the teacher's log-prob of the
token the student sampled and, only when the chosen divergence reads them, the teacher's top-k
(ids and log-probs) or its full log-softmax. It shares the trainer's forward
(:func:`~loongsage.core.model_math.logprobs.policy_logits`: LM head only from the first response
position on, fp32 head), its token-budget micro-batching and its handling of multi-segment rows
(each segment scored alone, as the student generated it: :mod:`loongsage.core.segments`). With
``share_prompts`` it computes each prompt once for the rows of a micro-batch that begin with it, as
the trainer does (:mod:`~loongsage.core.trainer.shared_prompts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from loongsage.core.contracts import Teacher
from loongsage.core.model_math.dtypes import DTYPES
from loongsage.core.model_math.logprobs import head_logits, policy_logits, response_start
from loongsage.core.segments import segment_layout
from loongsage.core.trainer.micro_batching import PASS_OVERHEAD_TOKENS, micro_batches
from loongsage.core.trainer.shared_prompts import check_attention, shared_groups, shared_prompt_hidden
from loongsage.core.types import TrainBatch


@dataclass
class EmbeddedTeacher(Teacher):
    """``embedded``: an HF causal LM scoring the student's tokens, forward only (kind ``teacher``).

    ``model_path`` is supplied by the framework from the teacher spec's ``path`` or ``builder``.
    """

    kind = "teacher"

    model_path: str
    dtype: str = "float32"
    device: str = "cpu"
    fp32_lm_head: bool = True
    micro_batch_tokens: int = 8192  # token budget of one forward (padded length x rows)
    # a prompt computed once for the rows of a micro-batch that begin with it (trainer/shared_prompts.py)
    share_prompts: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; allowed: {', '.join(DTYPES)}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens}: must be >= 1")
        self.model, self.vocab_size = self._load_model()
        self.model.eval().requires_grad_(False)
        if self.share_prompts:
            check_attention(self.model)

    def _load_model(self) -> tuple[torch.nn.Module, int]:
        """The frozen model on its device, and the size of the vocabulary it scores."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=DTYPES[self.dtype]).to(self.device)
        return model, int(model.get_output_embeddings().weight.shape[0])

    def _logits(self, input_ids: Tensor, attention_mask: Tensor, first: int) -> Tensor:
        """Logits at positions ``first-1..T-1`` (the trainer's forward)."""
        return policy_logits(self.model, input_ids, attention_mask, first, fp32_lm_head=self.fp32_lm_head)

    @torch.no_grad()
    def score(self, batch: TrainBatch, topk: int = 0, full_vocab: bool = False) -> dict[str, Tensor | None]:
        """The teacher's view of ``batch`` (the student's tokens), zero outside ``response_mask``.

        Returns ``logprobs`` [B, T] (log-prob of each token given the tokens before it) and
        ``dist_ids`` / ``dist_logprobs``: with ``topk`` > 0 the k most likely tokens per position
        and their log-probs [B, T, k]; with ``full_vocab`` ids None and the log-softmax [B, T, V];
        else both None. Asking for both is an error (one divergence reads one of them).
        """
        if topk < 0:
            raise ValueError(f"topk={topk}: must be >= 0 (0 = no top-k)")
        if topk and full_vocab:
            raise ValueError("topk and full_vocab: ask for one support, not both")
        if topk > self.vocab_size:
            raise ValueError(f"topk={topk}: exceeds the teacher's vocabulary ({self.vocab_size} tokens)")
        B, T = batch.input_ids.shape
        width = topk or (self.vocab_size if full_vocab else 0)
        out_lp = torch.zeros(B, T)
        dist_ids = torch.zeros(B, T, topk, dtype=torch.long) if topk else None
        dist_lp = torch.zeros(B, T, width) if width else None
        row = 0
        for mb in micro_batches(batch, self.micro_batch_tokens):
            n, t = mb.input_ids.shape
            layout = segment_layout(mb)
            if layout is None:
                lp, first, ids_k, lp_k = self._score_sequences(mb, topk, full_vocab)
            else:  # each segment scored alone (as the student generated it), put back in its row
                lp, seq_first, ids_k, lp_k = self._score_sequences(layout.split_batch(mb), topk, full_vocab)
                first = max(response_start(mb.response_mask), 1)
                lp = layout.merge(lp, t)
                ids_k, lp_k = (
                    None if x is None else layout.merge(x, t, first=seq_first, out_first=first) for x in (ids_k, lp_k)
                )
            out_lp[row : row + n, :t] = lp.cpu()
            if ids_k is not None:
                dist_ids[row : row + n, first:t] = ids_k.cpu()
            if lp_k is not None:
                dist_lp[row : row + n, first:t] = lp_k.cpu()
            row += n
        mask = batch.response_mask != 0
        out_lp = torch.where(mask, out_lp, torch.zeros_like(out_lp))
        if dist_lp is not None:
            dist_lp = torch.where(mask.unsqueeze(-1), dist_lp, torch.zeros_like(dist_lp))
        if dist_ids is not None:
            dist_ids = torch.where(mask.unsqueeze(-1), dist_ids, torch.zeros_like(dist_ids))
        return {"logprobs": out_lp, "dist_ids": dist_ids, "dist_logprobs": dist_lp}

    def _score_sequences(
        self, mb: TrainBatch, topk: int, full_vocab: bool
    ) -> tuple[Tensor, int, Tensor | None, Tensor | None]:
        """Rows that are whole sequences: the log-prob of every token ``[n, t]`` (0 before the first
        trained position), that position, and the support's ids and log-probs from it on
        ``[n, t - first, k]`` (``None`` where not asked for)."""
        ids = mb.input_ids.to(self.device)
        first = max(response_start(mb.response_mask), 1)
        groups = shared_groups(mb, PASS_OVERHEAD_TOKENS) if self.share_prompts else None
        if groups is None:
            logits = self._logits(ids, mb.attention_mask.to(self.device), first)
        else:  # a row's columns before its own first trained token read zeros: masked out in score()
            hidden = shared_prompt_hidden(self.model.model, ids, groups)
            logits = head_logits(self.model, hidden, first, fp32_lm_head=self.fp32_lm_head)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # positions first..t-1
        lp = F.pad(logp.gather(-1, ids[:, first:].unsqueeze(-1)).squeeze(-1), (first, 0))
        if topk:
            values, indices = logp.topk(topk, dim=-1)
            return lp, first, indices, values
        return lp, first, None, (logp if full_vocab else None)
