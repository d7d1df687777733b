"""``bf16``: K and V as raw bfloat16 bytes; exact for bfloat16 KV, lossy for float32 and float16."""

from __future__ import annotations

import torch

from server.cluster.codecs.raw import RawCodec


class BF16(RawCodec):
    name = "bf16"
    wire = torch.bfloat16
