"""Token sampling in two Triton kernels: the torch path's inverse-CDF draw without its passes over
the vocabulary (``log_softmax``, ``exp``, a full-vocabulary ``cumsum``, ``searchsorted``, a gather).

Sampling is bound by reading each row's float32 logits (600 KB a row at Qwen3's 151,936 tokens).
One program per row cannot fill the GPU at decode batch sizes (128 rows on 132 multiprocessors,
each walking its row serially: about ten times the bandwidth bound on an H200), so each row's
vocabulary is cut into chunks of whole blocks, enough of them that ``rows x chunks`` programs (a
few per multiprocessor) keep the memory busy, and two kernels share the work:

1. one program per (row, chunk) reads its chunk once and writes four numbers: the chunk's maximum,
   the first index of that maximum, and the chunk's softmax denominators relative to its own
   maximum at temperature 1 (for the log-prob) and at the row's temperature (for the draw). The
   sums follow the chunk's running maximum, one number, not one per lane: two exponentials a
   logit instead of four, which at this bandwidth would otherwise rival the reads;
2. one program per row merges its chunks' numbers (each denominator rescaled from its chunk's
   maximum to the row's, ``exp((m_c - m) / t)``) into the row's maximum, greedy token (the first
   index of the maximum: ties go to the lowest index, as ``argmax``) and denominators. A sampled
   row's target is ``u`` times its total mass at its temperature; the chunk holding the target is
   the first whose cumulative mass, summed in chunk order, exceeds it, and only that chunk's
   logits are read again, block by block up to the block that holds it, for the first token
   whose cumulative mass exceeds the target: the same rule as the torch path's
   ``searchsorted(cdf, u * total, right=True)``, so a row's uniform number picks the same token up
   to float rounding at a CDF boundary. Where rounding leaves the target at or past the summed
   mass, the draw takes the last token with nonzero mass (the last such token of the last chunk
   with nonzero mass: the row's last possible token when the target is past everything).

The reported log-prob is the raw policy's at temperature 1, as on the torch path. Sizes depend on
shapes alone and nothing is read back to the host, so a call can be captured in a CUDA graph.
Rows with top-k, top-p or min-p filters stay on the torch path.

Chunks sized by the batch make a row's maximum, denominators and log-prob depend, in their last
bits, on how many rows were sampled with it. The batch-invariant consistency mode
(``fixed_chunks=True``) cuts every row into chunks of ``_CHUNK_BLOCKS`` blocks, their number set by
the vocabulary alone; ``token_logprobs_rows`` (the trainer's side, ``InvariantTokenLogprobs`` with a
gradient) runs the same two kernels on given tokens, so a drawn token's log-prob is the same number
bit for bit in the engine's batch and in the trainer's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 2048  # logits a program reads at once
_CHUNK_BLOCKS = 4  # blocks in a chunk, at most: bounds the second kernel's walk through one chunk
_PROGRAMS_PER_SM = 8  # (row, chunk) programs to aim for per multiprocessor


@triton.jit
def _chunk_kernel(
    logits_ptr,
    rows_ptr,
    inv_t_ptr,
    stats_ptr,
    arg_ptr,
    vocab,
    stride,
    chunk,
    splits,
    BLOCK: tl.constexpr,
    SAMPLED: tl.constexpr,
):
    i = tl.program_id(0)
    c = tl.program_id(1)
    base = logits_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride
    if SAMPLED:  # else no temperature sums (a greedy batch, or given tokens' log-probs)
        inv_t = tl.load(inv_t_ptr + i)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, vocab)
    cols = tl.arange(0, BLOCK)
    # The sums are kept relative to the chunk's running maximum, a scalar: two exponentials a logit
    # (one per temperature), where a running maximum per lane would need four (the rescale too).
    # The per-lane maxima only locate the first index of the maximum.
    m = tl.full([], float("-inf"), tl.float32)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK], tl.int32)
    total = tl.zeros([BLOCK], tl.float32)
    total_t = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK):
        at = start + cols
        x = tl.load(base + at, mask=at < hi, other=float("-inf"))
        new = tl.maximum(m, tl.max(x, axis=0))
        ref = tl.where(new > float("-inf"), new, 0.0)  # all -inf so far: no mass, and no -inf - -inf
        total = total * tl.exp(m - ref) + tl.exp(x - ref)
        if SAMPLED:
            total_t = total_t * tl.exp((m - ref) * inv_t) + tl.exp((x - ref) * inv_t)
        arg = tl.where(x > top, at, arg)
        top = tl.maximum(top, x)
        m = new
    out = stats_ptr + (i * 3) * splits + c
    tl.store(out, m)
    tl.store(out + splits, tl.sum(total, axis=0))
    tl.store(out + 2 * splits, tl.sum(total_t, axis=0))
    tl.store(arg_ptr + i * splits + c, tl.min(tl.where(top == m, arg, vocab), axis=0))


@triton.jit
def _draw_kernel(
    logits_ptr,
    rows_ptr,
    stats_ptr,
    arg_ptr,
    u_ptr,
    inv_t_ptr,
    greedy_ptr,
    tok_ptr,
    lp_ptr,
    vocab,
    stride,
    chunk,
    splits,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    SAMPLED: tl.constexpr,
    GIVEN: tl.constexpr,
):
    # GIVEN: the token is read from tok_ptr (token_logprobs_rows) instead of chosen and written there;
    # the row's maximum and denominator below are the same code either way, so is its log-prob
    i = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride
    s = tl.arange(0, SPLITS)
    real = s < splits
    at_s = stats_ptr + (i * 3) * splits + s
    m_c = tl.load(at_s, mask=real, other=float("-inf"))
    m = tl.max(m_c, axis=0)
    if GIVEN:
        tok = tl.load(tok_ptr + i)
    else:
        # the first chunk holding the maximum holds its first index
        tok = tl.min(tl.where(m_c == m, tl.load(arg_ptr + i * splits + s, mask=real, other=vocab), vocab), axis=0)
    seen = m_c > float("-inf")  # a chunk of -inf logits (or past the last) adds nothing
    z = tl.sum(tl.where(seen, tl.load(at_s + splits, mask=real, other=0.0) * tl.exp(m_c - m), 0.0), axis=0)
    if SAMPLED:
        inv_t = tl.load(inv_t_ptr + i)
        if tl.load(greedy_ptr + i) == 0:
            mass = tl.where(seen, tl.load(at_s + 2 * splits, mask=real, other=0.0) * tl.exp((m_c - m) * inv_t), 0.0)
            cdf = tl.cumsum(mass, axis=0)
            target = tl.load(u_ptr + i) * tl.sum(mass, axis=0)
            hit = tl.min(tl.where(cdf > target, s, SPLITS), axis=0)
            # rounding may leave the target at or past the summed mass: the last chunk with mass
            c = tl.where(hit < SPLITS, hit, tl.max(tl.where(mass > 0, s, 0), axis=0))
            running = tl.sum(tl.where(s == c - 1, cdf, 0.0), axis=0)  # the mass before chunk c, as compared
            lo = c * chunk
            hi = tl.minimum(lo + chunk, vocab)
            cols = tl.arange(0, BLOCK)
            found = vocab
            last = lo
            start = lo
            while (start < hi) & (found == vocab):  # past the found token no block can find an earlier one
                at = start + cols
                x = tl.load(base + at, mask=at < hi, other=float("-inf"))
                p = tl.exp((x - m) * inv_t)
                found = tl.minimum(found, tl.min(tl.where(running + tl.cumsum(p, axis=0) > target, at, vocab), axis=0))
                last = tl.maximum(last, tl.max(tl.where(p > 0, at, 0), axis=0))
                running += tl.sum(p, axis=0)
                start += BLOCK
            # rounding may leave the target at or past the chunk's summed mass: its last possible token
            tok = tl.where(found < vocab, found, last)
    if not GIVEN:
        tl.store(tok_ptr + i, tok)
    tl.store(lp_ptr + i, tl.load(base + tok) - m - tl.log(z))


def chunks_for(rows: int, vocab: int, programs: int) -> tuple[int, int]:
    """``(chunk, splits)``: each row's vocabulary cut into ``splits`` chunks of ``chunk`` logits
    (whole blocks, the last chunk shorter), enough that ``rows * splits`` reaches ``programs``
    where the vocabulary allows, and each chunk at most ``_CHUNK_BLOCKS`` blocks long."""
    blocks = -(-vocab // _BLOCK)
    want = -(-programs // max(rows, 1))
    per = min(max(1, -(-blocks // want)), _CHUNK_BLOCKS)
    return per * _BLOCK, -(-blocks // per)


def fixed_chunks_for(vocab: int) -> tuple[int, int]:
    """``(chunk, splits)`` of the batch-invariant mode: chunks of ``_CHUNK_BLOCKS`` blocks, their
    number set by the vocabulary alone (not by the rows or the GPU), so a row's maximum,
    denominators and log-prob are summed the same way in any batch."""
    chunk = _CHUNK_BLOCKS * _BLOCK
    return chunk, max(1, -(-vocab // chunk))


def sample_rows(
    logits: Tensor,
    rows: Tensor,
    uniforms: Tensor | None,
    inv_temperature: Tensor,
    greedy: Tensor,
    fixed_chunks: bool = False,
) -> tuple[Tensor, Tensor]:
    """Sample one token from each of ``logits[rows]`` (float32 ``[*, V]``, unit stride on V).

    ``uniforms`` ``[n]`` (None when every row is greedy), ``inv_temperature`` ``[n]``, ``greedy``
    ``[n]`` bool. Returns ``(tokens [n] long, logprobs [n] float32)``.

    ``fixed_chunks``: cut the vocabulary by :func:`fixed_chunks_for` rather than by the number of
    rows, so a row's log-prob (and draw) is computed the same way whatever batch it is in, and
    equals :func:`token_logprobs_rows`' for the token drawn, bit for bit. Otherwise the chunks
    follow the batch (:func:`chunks_for`), for bandwidth: the results then change in their last
    bits with the batch size.
    """
    n, vocab = rows.numel(), logits.shape[-1]
    device = logits.device
    if fixed_chunks:
        chunk, splits = fixed_chunks_for(vocab)
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if logits.is_cuda else 1
        chunk, splits = chunks_for(n, vocab, _PROGRAMS_PER_SM * sms)
    tokens = torch.empty(n, dtype=torch.int32, device=device)
    logprobs = torch.empty(n, dtype=torch.float32, device=device)
    sampled = uniforms is not None  # else every row is greedy: no temperature sums, no draw
    _launch(logits, rows, chunk, splits, uniforms, inv_temperature, greedy, tokens, logprobs, sampled, given=False)
    return tokens.long(), logprobs


def token_logprobs_rows(logits: Tensor, rows: Tensor, tokens: Tensor) -> Tensor:
    """The float32 log-prob ``logits[row, token] - max - log(sum(exp(logits[row] - max)))`` of
    ``tokens[i]`` (``[n]``, integer, each in ``[0, V)``: not checked) in each row ``rows[i]`` of
    ``logits`` (float32 ``[*, V]``, unit stride on V).

    Computed by the kernels of ``sample_rows(..., fixed_chunks=True)``, the same code for the
    row's maximum and denominator, so for a row and the token the sampler drew the two log-probs
    are equal bit for bit, in any batch. Sizes depend on shapes alone and nothing is read back to
    the host: a call can be captured in a CUDA graph.
    """
    n, vocab = rows.numel(), logits.shape[-1]
    chunk, splits = fixed_chunks_for(vocab)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    _launch(logits, rows, chunk, splits, None, logprobs, None, tokens, logprobs, False, given=True)
    return logprobs


def _launch(
    logits: Tensor,
    rows: Tensor,
    chunk: int,
    splits: int,
    uniforms: Tensor | None,
    inv_temperature: Tensor,
    greedy: Tensor | None,
    tokens: Tensor,
    logprobs: Tensor,
    sampled: bool,
    given: bool,
) -> None:
    """The two kernels over ``rows``: ``tokens`` written (chosen), or read (``given``)."""
    n, vocab = rows.numel(), logits.shape[-1]
    if n == 0:
        return
    device = logits.device
    stats = torch.empty(n * 3 * splits, dtype=torch.float32, device=device)  # [n, 3, splits]: max, z, z_t
    args = torch.empty(n * splits, dtype=torch.int32, device=device)  # [n, splits]: first index of the max
    # pointers the kernels do not read without a draw (not sampled: no temperature, no uniform)
    uniforms = inv_temperature if uniforms is None else uniforms
    greedy = inv_temperature if greedy is None else greedy
    stride = logits.stride(0)
    _chunk_kernel[(n, splits)](
        logits,
        rows,
        inv_temperature,
        stats,
        args,
        vocab,
        stride,
        chunk,
        splits,
        BLOCK=_BLOCK,
        SAMPLED=sampled,
    )
    _draw_kernel[(n,)](
        logits,
        rows,
        stats,
        args,
        uniforms,
        inv_temperature,
        greedy,
        tokens,
        logprobs,
        vocab,
        stride,
        chunk,
        splits,
        SPLITS=triton.next_power_of_2(splits),
        BLOCK=_BLOCK,
        SAMPLED=sampled,
        GIVEN=given,
    )


class InvariantTokenLogprobs(torch.autograd.Function):
    """``log_softmax(logits)[i, tokens[i]]`` (``logits`` float32 ``[N, V]``, ``tokens`` ``[N]``
    long) by :func:`token_logprobs_rows`: bit for bit the log-prob the batch-invariant sampler
    reports for the token it drew. The backward is torch's, in float32:
    ``grad[:, None] * (one_hot(tokens) - softmax(logits))``."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor) -> Tensor:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        ctx.save_for_backward(logits, tokens)
        rows = torch.arange(logits.shape[0], device=logits.device)
        return token_logprobs_rows(logits, rows, tokens)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        logits, tokens = ctx.saved_tensors
        # one_hot - softmax without a second [N, V] buffer: -p everywhere, 1 - p at the token
        # (the same single rounding as one_hot(tokens) - p), then times the row's gradient
        grad_logits = torch.softmax(logits.float(), -1).neg_()
        grad_logits[torch.arange(logits.shape[0], device=logits.device), tokens] += 1.0
        return grad_logits.mul_(grad.float()[:, None]), None
