"""The ``sglang`` engine backend: SGLang servers driven over their HTTP API with token ids."""
