"""The forward of a Megatron GPT model built by :mod:`loongsage.megatron.model`: hidden states and
float32 logits of padded, packed or context-split rows (the FP32 head on the last pipeline stage),
and R3's replay of the engine's routed experts inside it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from loongsage.megatron import context, packing


def _router_replays(model: Any) -> list[Any]:
    return [m.router_replay for m in model.modules() if getattr(m, "router_replay", None) is not None]


def clear_routes(model: Any) -> None:
    """Drop every router's replay state (targets kept for a backward recomputation included)."""
    for replay in _router_replays(model):
        replay.clear_indices()
        replay.clear_router_replay_action()


@contextmanager
def replayed_routes(model: Any, routes: torch.Tensor | None, *, for_backward: bool = False) -> Iterator[None]:
    """R3 routing replay for the forwards inside: every MoE layer routes each token to the experts
    in ``routes`` ``[b, s, layers, topk]`` (the engine's choices; under pipeline parallelism this
    stage's layers are picked) instead of its own top k; the gates are still the router's scores
    at those experts, so their gradient flows. Without recomputation the backward reuses the
    forward's routing and the routes are dropped after the forward. With it (``for_backward``)
    each router queues them: the backward's recomputation of a layer takes the oldest queued
    routes, which is the right micro-batch's whenever backwards run in the order of their forwards
    (the pipeline's schedule does), until :func:`clear_routes`. ``routes`` None: the routers route
    on their own for these forwards."""
    replays = _router_replays(model)
    if routes is None:
        for replay in replays:
            replay.clear_router_replay_action()
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    first = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0  # the stage's first layer
    if routes.dim() != 4 or routes.shape[2] < first + len(replays):
        raise ValueError(
            f"routed_experts: {list(routes.shape)} per micro-batch; expected [rows, tokens, "
            f"{model.config.num_layers} MoE layers, top-k]"
        )
    routes = routes[:, :, first : first + len(replays)]
    if model.config.sequence_parallel:  # a router sees this rank's share of the sequence
        from megatron.core import parallel_state

        share = routes.shape[1] // parallel_state.get_tensor_model_parallel_world_size()
        start = parallel_state.get_tensor_model_parallel_rank() * share
        routes = routes[:, start : start + share]
    for layer, replay in enumerate(replays):  # Megatron's router sees tokens sequence-major: [s * b, topk]
        replay.set_target_indices(routes[:, :, layer].transpose(0, 1).reshape(-1, routes.shape[-1]))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        if for_backward:
            for replay in replays:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        else:
            clear_routes(model)


def gpt_hidden(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    routes: torch.Tensor | None = None,
    replay_in_backward: bool = False,
    input_tensor: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder's output for a micro-batch: :func:`decoder_output`'s hidden states."""
    return decoder_output(
        model,
        input_ids,
        attention_mask,
        routes=routes,
        replay_in_backward=replay_in_backward,
        input_tensor=input_tensor,
    )[0]


def decoder_output(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    routes: torch.Tensor | None = None,
    replay_in_backward: bool = False,
    input_tensor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, packing.Packed | None]:
    """The decoder's output ``[s, b, hidden]`` for a micro-batch (padded as :func:`_common_shape`
    says; under sequence parallelism this rank's share of ``s``): after the final norm on the
    last pipeline stage, the stage's last layer's output on another, ``input_tensor`` being the
    previous stage's output (None on the first stage).

    Positions run 0..T-1 whatever the padding, as the HF model numbers them without
    ``position_ids``. Rows padded on the right only (as rollouts are) need no mask beyond the
    causal one: a real token never attends to a later pad, and the attention runs as plain causal
    (the flash kernel on a GPU). Otherwise a padded key is masked, and every position attends at
    least to itself (a padding row's output is never used, but a row attending to nothing would
    be NaN).

    With ``pack_sequences`` the rows run packed (:mod:`.packing`): the output is
    ``[packed length, 1, hidden]``, returned with the packing that :func:`packing.unpack` reverses
    (None otherwise)."""
    if getattr(model, "packed_sequences", False):
        return _packed_decoder_output(model, input_ids, attention_mask, routes, replay_in_backward, input_tensor)
    input_ids, attention_mask, routes = _common_shape(model, input_ids, attention_mask, routes)
    device, length = input_ids.device, input_ids.shape[1]
    positions = torch.arange(length, device=device).expand(*input_ids.shape)
    masked = None
    right_padded = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
    cp = model.config.context_parallel_size
    if cp > 1:  # this rank's chunks of the tokens (Megatron's rotary gives them their positions)
        if not right_padded:
            raise ValueError("context_parallel: rows must be padded on the right only (causal attention)")
        if routes is not None:
            raise ValueError("context_parallel: routing replay (R3) is not supported with context parallelism yet")
        mine = context.local_positions(length, *context.size_and_rank()).to(device)
        input_ids, positions = input_ids[:, mine], positions[:, mine]
    elif not right_padded:
        if getattr(model, "transformer_engine", False):  # its attention runs causal, whatever mask it is handed
            raise ValueError(
                "layer_spec te: rows must be padded on the right only (causal attention); "
                "allowed: layer_spec sdpa for rows padded on the left"
            )
        causal = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
        masked = (causal | ~attention_mask.bool()[:, None, :]) & ~torch.eye(length, dtype=torch.bool, device=device)
        masked = masked[:, None]
    return _decoder(model, input_ids, positions, masked, routes, replay_in_backward, input_tensor), None


def _packed_decoder_output(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    routes: torch.Tensor | None,
    replay_in_backward: bool,
    input_tensor: torch.Tensor | None,
) -> tuple[torch.Tensor, packing.Packed]:
    from megatron.core import parallel_state

    cfg = model.config
    group = parallel_state.get_expert_tensor_and_model_parallel_group() if cfg.expert_model_parallel_size > 1 else None
    packed = packing.pack(input_ids, attention_mask, routes, multiple=cfg.tensor_model_parallel_size, ep_group=group)
    hidden = _decoder(
        model,
        packed.input_ids,
        packed.positions,
        None,
        packed.routes,
        replay_in_backward,
        input_tensor,
        packed_seq_params=packed.params,
    )
    return hidden, packed


def _decoder(
    model: Any,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    masked: torch.Tensor | None,
    routes: torch.Tensor | None,
    replay_in_backward: bool,
    input_tensor: torch.Tensor | None,
    **extra: Any,
) -> torch.Tensor:
    if not model.pre_process:
        model.set_input_tensor(input_tensor)
    post_process, model.post_process = model.post_process, False  # GPTModel.forward returns the decoder's output
    try:
        with replayed_routes(model, routes, for_backward=replay_in_backward):
            return model(input_ids, positions, masked, **extra)
    finally:
        model.post_process = post_process


def gpt_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    first: int,
    *,
    vocab: int,
    routes: torch.Tensor | None = None,
    replay_in_backward: bool = False,
    input_tensor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 logits ``[b, T - first + 1, vocab]`` at positions ``first-1..T-1`` of a ``GPTModel``
    (the trainer's and the teacher's forward; on the last pipeline stage, from the previous
    stage's ``input_tensor``); under tensor parallelism this rank's vocabulary rows (``vocab``
    slices only a whole vocabulary).

    The output layer runs here, on batch-first hidden states of the kept positions: Megatron's own
    post-process runs it on every position and returns ``[b, s, vocab]`` by a contiguous copy of
    the whole logits (10 GB at 4 x 4096 with Qwen's vocabulary, copied again in the backward).
    """
    b, t = input_ids.shape
    hidden, packed = _whole_sequence(
        model,
        input_ids,
        attention_mask,
        routes=routes,
        replay_in_backward=replay_in_backward,
        input_tensor=input_tensor,
    )
    if packed is not None:
        hidden = packing.unpack(hidden, packed)
    return _head(model, hidden[first - 1 : t, :b].transpose(0, 1))[..., :vocab]


def gpt_packed_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    first: int,
    *,
    routes: torch.Tensor | None = None,
    replay_in_backward: bool = False,
    input_tensor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """With ``pack_sequences``: float32 logits ``[1, n, vocab rows]`` of the tokens a log-prob is
    read from (real tokens at positions ``first-1..T-2`` whose next token is real too), the head
    running on those only; and where they are, ``[b, T - 1]`` (True at each one's position; the
    log-prob it gives belongs to the next position)."""
    hidden, packed = _whole_sequence(
        model,
        input_ids,
        attention_mask,
        routes=routes,
        replay_in_backward=replay_in_backward,
        input_tensor=input_tensor,
    )
    real = packed.real
    place = real.flatten().cumsum(0).view_as(real) - 1  # each real token's place in the packed sequence
    scored = real[:, :-1] & real[:, 1:]
    scored[:, : first - 1] = False
    return _head(model, hidden[place[:, :-1][scored], 0][None]), scored


def gpt_local_logits(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, input_tensor: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Under context parallelism: float32 logits ``[b, tokens here, vocab rows]`` of the tokens this
    rank holds, and their positions in the (padded) sequence (:mod:`loongsage.megatron.context`)."""
    b = input_ids.shape[0]
    hidden, _ = _whole_sequence(model, input_ids, attention_mask, input_tensor=input_tensor)
    length = hidden.shape[0] * model.config.context_parallel_size
    positions = context.local_positions(length, *context.size_and_rank())
    return _head(model, hidden[:, :b].transpose(0, 1)), positions


def _whole_sequence(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **forward: Any
) -> tuple[torch.Tensor, packing.Packed | None]:
    """:func:`decoder_output`, each rank's share of the tokens gathered whole under sequence
    parallelism (the gradient split back)."""
    hidden, packed = decoder_output(model, input_ids, attention_mask, **forward)
    if model.config.sequence_parallel:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    return hidden, packed


def _head(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits of the output layer (a tied model's embedding as its weight) over ``hidden``."""
    tied = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=tied)
    return logits.float()


def _common_shape(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, routes: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The micro-batch padded to the largest ``[rows, tokens]`` over the expert-parallel ranks
    (Megatron's all-gather dispatcher exchanges equal token counts), its length to a multiple of
    the tensor-parallel size (sequence parallelism splits it evenly). Padding is masked tokens on
    the right and masked rows below (routed to experts ``0..topk-1`` under R3), whose outputs are
    cut off again."""
    cfg = model.config
    if cfg.expert_model_parallel_size == 1 and not cfg.sequence_parallel and cfg.context_parallel_size == 1:
        return input_ids, attention_mask, routes
    b, t = input_ids.shape
    shape = torch.tensor([b, t])
    if cfg.expert_model_parallel_size > 1:
        import torch.distributed as dist

        from megatron.core import parallel_state

        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_tensor_and_model_parallel_group())
    multiple = cfg.tensor_model_parallel_size * 2 * cfg.context_parallel_size  # each rank's share: equal chunks
    rows, length = int(shape[0]) - b, -(-int(shape[1]) // multiple) * multiple - t
    if rows == 0 and length == 0:
        return input_ids, attention_mask, routes
    input_ids = F.pad(input_ids, (0, length, 0, rows))
    attention_mask = F.pad(attention_mask, (0, length, 0, rows))
    if routes is not None:
        topk = routes.shape[-1]
        padded = torch.arange(topk, device=routes.device).expand(b + rows, t + length, routes.shape[2], topk).clone()
        padded[:b, :t] = routes
        routes = padded
    return input_ids, attention_mask, routes
