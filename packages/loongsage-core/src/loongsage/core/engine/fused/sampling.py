"""Token sampling in one Triton kernel: the torch path's inverse-CDF draw without its passes over
the vocabulary (``log_softmax``, ``exp``, a full-vocabulary ``cumsum``, ``searchsorted``, a gather).

One program per row reads the row's float32 logits twice. The first pass keeps the running
maximum, the first index of the maximum (greedy), and the softmax denominators at temperature 1
(for the log-prob) and at the row's temperature (for the draw). The second pass walks the
unnormalised probabilities block by block and returns the first token whose cumulative mass
exceeds ``u`` times the total: the same rule as the torch path's ``searchsorted(cdf, u * total,
right=True)``, so a row's uniform number picks the same token up to float rounding at a CDF
boundary. The reported log-prob is the raw policy's at temperature 1, as on the torch path.
Rows with top-k, top-p or min-p filters stay on the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 2048


@triton.jit
def _sample_kernel(
    logits_ptr, rows_ptr, u_ptr, inv_t_ptr, greedy_ptr, tok_ptr, lp_ptr, vocab, stride, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride
    inv_t = tl.load(inv_t_ptr + i)
    cols = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max, and sums relative to it
    arg = tl.zeros([BLOCK], tl.int32)
    total = tl.zeros([BLOCK], tl.float32)
    total_t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        at = start + cols
        x = tl.load(base + at, mask=at < vocab, other=float("-inf"))
        new = tl.maximum(top, x)
        seen = new > float("-inf")
        scale = tl.where(seen, tl.exp(top - new), 0.0)
        total = total * scale + tl.where(seen, tl.exp(x - new), 0.0)
        total_t = total_t * tl.where(seen, tl.exp((top - new) * inv_t), 0.0) + tl.where(
            seen, tl.exp((x - new) * inv_t), 0.0
        )
        arg = tl.where(x > top, at, arg)
        top = new
    m = tl.max(top, axis=0)
    greedy_tok = tl.min(tl.where(top == m, arg, vocab), axis=0)
    z = tl.sum(total * tl.exp(top - m), axis=0)
    z_t = tl.sum(total_t * tl.exp((top - m) * inv_t), axis=0)
    tok = greedy_tok
    if tl.load(greedy_ptr + i) == 0:
        target = tl.load(u_ptr + i) * z_t
        running = 0.0
        found = vocab
        last = 0
        for start in range(0, vocab, BLOCK):
            at = start + cols
            x = tl.load(base + at, mask=at < vocab, other=float("-inf"))
            p = tl.exp((x - m) * inv_t)
            cdf = running + tl.cumsum(p, axis=0)
            found = tl.minimum(found, tl.min(tl.where(cdf > target, at, vocab), axis=0))
            last = tl.maximum(last, tl.max(tl.where(p > 0, at, 0), axis=0))
            running += tl.sum(p, axis=0)
        # rounding may leave the target at or past the summed mass: take the last possible token
        tok = tl.where(found < vocab, found, last)
    tl.store(tok_ptr + i, tok)
    tl.store(lp_ptr + i, tl.load(base + tok) - m - tl.log(z))


def sample_rows(
    logits: Tensor, rows: Tensor, uniforms: Tensor | None, inv_temperature: Tensor, greedy: Tensor
) -> tuple[Tensor, Tensor]:
    """Sample one token from each of ``logits[rows]`` (float32 ``[*, V]``, unit stride on V).

    ``uniforms`` ``[n]`` (None when every row is greedy), ``inv_temperature`` ``[n]``, ``greedy``
    ``[n]`` bool. Returns ``(tokens [n] long, logprobs [n] float32)``.
    """
    n, vocab = rows.numel(), logits.shape[-1]
    tokens = torch.empty(n, dtype=torch.int32, device=logits.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    if uniforms is None:
        uniforms = inv_temperature  # never read: every row is greedy
    _sample_kernel[(n,)](
        logits, rows, uniforms, inv_temperature, greedy, tokens, logprobs, vocab, logits.stride(0), BLOCK=_BLOCK
    )
    return tokens.long(), logprobs
