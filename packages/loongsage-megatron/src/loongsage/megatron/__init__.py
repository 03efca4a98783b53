"""LoongSage on Megatron-Core (see docs/megatron.md)."""
