"""The slot batch's device state (:class:`~loongsage.core.engine.continuous.SlotBatch`): the KV
buffers and the per-slot tensors, each with the slot as its first dimension, grown by copying
into larger ones (a captured decode graph holds their addresses, so they are never resized in place)."""

from __future__ import annotations

import torch
from torch import Tensor

Spec = dict[str, tuple[tuple[int, ...], torch.dtype, float | int | bool]]  # name -> (shape past the slot, dtype, fill)


def slot_spec(max_model_len: int, stop_width: int, routes: tuple[int, int] | None) -> Spec:
    """The per-slot tensors: a row's scalars, its per-column outputs and sampling settings;
    ``routes`` (MoE layers, top-k) adds the experts each layer chose, per column as the keys."""
    L = max_model_len
    spec: Spec = {
        "lens": ((), torch.long, 0),
        "gen": ((), torch.long, 0),
        "limit": ((), torch.long, 1),
        "last": ((), torch.long, 0),
        "tokens": ((L,), torch.long, 0),
        "logprobs": ((L,), torch.float32, 0),
        "versions": ((L,), torch.int32, 0),
        "uniforms": ((L,), torch.float32, 0),
        "stops": ((stop_width,), torch.long, -1),
        "inv_t": ((), torch.float32, 1),
        "greedy": ((), torch.bool, True),
        "top_k": ((), torch.long, 0),
        "top_p": ((), torch.float32, 1),
        "min_p": ((), torch.float32, 0),
        # decoding and not finished; finished since the last read-back; finished by a stop token
        "active": ((), torch.bool, False),
        "finished": ((), torch.bool, False),
        "stopped": ((), torch.bool, False),
    }
    if routes is not None:
        spec["routes"] = ((L, *routes), torch.int16, 0)
    return spec


def grown(buf: Tensor | None, cap: int, tail: tuple[int, ...], dtype: torch.dtype, fill, device) -> Tensor:
    """A ``[cap, *tail]`` tensor filled with ``fill``, the slots of ``buf`` (if any) copied in.

    Filled, never ``empty``: a cache's masked columns still enter attention as 0 x value, and an
    uninitialised NaN there would poison the row."""
    out = torch.full((cap, *tail), fill, dtype=dtype, device=device)
    if buf is not None:
        out[: buf.shape[0]] = buf
    return out


class PrefixTiles:
    """The decoding rows of each request tiled for shared-prefix decode attention
    (:mod:`loongsage.core.engine.fused.attention`): ``members`` rows at most a tile, in device
    tables that the decode step's graphs read like the per-slot tensors (so remade, not resized,
    when the slots grow)."""

    def __init__(self, members: int) -> None:
        self.members = members
        self.tiles = self.first = torch.zeros(0, dtype=torch.int32)

    def grow(self, cap: int, device) -> None:
        """Empty tables for ``cap`` slots (at most one tile per two rows)."""
        self.tiles = torch.zeros((max(1, cap // 2), 2 + self.members), dtype=torch.int32, device=device)
        self.first = torch.zeros(cap, dtype=torch.int32, device=device)

    def tile(self, slots: list[int], slot_group: list) -> None:
        """Tile the decoding ``slots`` by request (each of a request's rows holds a copy of its
        prompt) into the tables."""
        from loongsage.core.engine.fused.attention import tile_tables  # Triton: only where fused

        requests: dict[int, tuple[list[int], int]] = {}
        for s in slots:
            group = slot_group[s]
            requests.setdefault(id(group), ([], len(group.prompt)))[0].append(s)
        tables = tile_tables(list(requests.values()), self.members, len(self.tiles), len(self.first))
        self.tiles.copy_(tables.tiles)
        self.first.copy_(tables.first)

    def shared(self, rows: int):
        """The :class:`~loongsage.core.engine.fused.attention.SharedPrefixes` of slots ``[0, rows)``;
        None under two rows."""
        if rows < 2:
            return None
        from loongsage.core.engine.fused.attention import SharedPrefixes

        return SharedPrefixes(self.tiles[: rows // 2], self.first[:rows])
