"""Megatron-Core on a machine without CUDA (tests, laptops): five places where it assumes a GPU.

* It passes ``torch.cuda.current_device()`` as the device of buffers it makes (rotary frequencies,
  the attention buffer, tensor-parallel gathers): the CPU is returned instead.
* Its RNG tracker saves and restores CUDA generator states (attention forks it even without
  dropout): the CPU generator stands in.
* Its default causal mask is made on ``"cuda"``: it is made on the CPU.
* Under pipeline parallelism it moves the last stage's copy of a tied embedding with ``.cuda()``
  before summing it with the first stage's: ``Tensor.cuda`` leaves a tensor where it is.
* Under context parallelism its rotary embedding picks this rank's positions through a pinned
  index tensor: an unpinned one stands in.

These patch ``torch.cuda`` for the whole process, so they are applied only in a process of
Megatron's own (a trainer worker, a test's subprocess) and only when CUDA is absent.
"""

from __future__ import annotations

import torch

_applied = False


def apply_cpu_shims() -> bool:
    """Patch once; False (nothing done) when CUDA is available."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    import megatron.core.tensor_parallel.random as megatron_random
    import megatron.core.transformer.utils as transformer_utils

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda device=None: torch.get_rng_state()
    torch.cuda.random.get_rng_state = lambda device=None: torch.get_rng_state()
    megatron_random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    def causal_mask(length: int) -> torch.Tensor:  # True where masked, as Megatron's
        return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)

    transformer_utils.get_default_causal_mask = causal_mask
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary

    def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
        cp, rank = cp_group.size(), cp_group.rank()
        chunks = pos_emb.chunk(2 * cp, dim=seq_dim)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=seq_dim)

    if hasattr(rotary, "get_pos_emb_on_this_cp_rank"):
        rotary.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    try:
        import megatron.core.fusions.fused_softmax as fused_softmax

        if hasattr(fused_softmax, "get_default_causal_mask"):
            fused_softmax.get_default_causal_mask = causal_mask
    except ImportError:
        pass
    _applied = True
    return True
