"""The dtypes a config names: the table every backend reads a ``dtype`` param through."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF_DTYPES = (torch.bfloat16, torch.float16)
