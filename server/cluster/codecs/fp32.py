"""``fp32``: K and V as raw float32 bytes; exact for float32, bfloat16 and float16 KV."""

from __future__ import annotations

import torch

from server.cluster.codecs.raw import RawCodec


class FP32(RawCodec):
    name = "fp32"
    wire = torch.float32
