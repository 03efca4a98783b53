"""The ``broadcast`` transport's weights straight into the SGLang server: the server joins the group.

With the ``broadcast`` transport the engine worker takes this receiver instead of the transport's
own (``SGLangEngine.weight_receiver``). At the sender's setup the server is told to join the
group (``/init_weights_update_group``: SGLang forms it as :mod:`loongsage.sync.group` does); for
each bucket it is told the bucket's tensors (``/update_weights_from_distributed`` with
``load_format: flattened_bucket``) and takes the broadcast itself, on its own GPU, into its own
weights. Nothing passes through the engine worker, and the commit only moves the version.

SGLang's flattened bucket is dense: the tensors back to back. The sender's buckets align every
tensor to 64 bytes, which for a model's tensors (bf16 rows of a multiple of 32 elements) is the
same layout; a bucket that holds padding is refused before the broadcast, in one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loongsage.sglang.engine import SGLangEngine


class ServerJoinsTheGroup:
    """A ``broadcast`` receiver whose work the engine's SGLang server does."""

    def __init__(self, engine: SGLangEngine):
        self.engine = engine
        self.group_name: str | None = None

    def setup(self, *, host: str, port: int, name: str, rank: int, world: int, backend: str, timeout_s: float) -> int:
        answer = self.engine.control(
            "/init_weights_update_group",
            {
                "master_address": host,
                "master_port": port,
                "rank_offset": rank,
                "world_size": world,
                "group_name": name,
                "backend": backend,
            },
            timeout_s=timeout_s,
        )
        if not (isinstance(answer, dict) and answer.get("success")):
            raise RuntimeError(f"sglang /init_weights_update_group refused: {answer!r}")
        self.group_name = name
        return rank

    def receive(self, metas: list, size: int, index: int = 0) -> list[Any]:
        if not metas:
            return []
        if self.group_name is None:
            raise RuntimeError("sglang weight group: the server joined none (the sender's setup did not reach it)")
        offset = 0
        for meta in metas:
            if meta.offset != offset:
                raise ValueError(
                    f"sglang weight group: the bucket pads before {meta.name!r} (at byte {meta.offset}, "
                    f"dense would be {offset}); SGLang's servers take dense buckets"
                )
            offset += meta.nbytes
        if offset != size:
            raise ValueError(
                f"sglang weight group: the bucket holds {size} bytes for {offset} of tensors; "
                "SGLang's servers take dense buckets"
            )
        answer = self.engine.control(
            "/update_weights_from_distributed",
            {
                "names": [m.name for m in metas],
                "dtypes": [m.dtype for m in metas],
                "shapes": [list(m.shape) for m in metas],
                "group_name": self.group_name,
                "load_format": "flattened_bucket",
                "flush_cache": False,
            },
        )
        if not (isinstance(answer, dict) and answer.get("success")):
            raise RuntimeError(f"sglang /update_weights_from_distributed failed: {answer!r}")
        return []  # the server holds them already: nothing to stage
