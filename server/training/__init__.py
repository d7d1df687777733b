"""Cache-conditioned fine-tuning of decode modules (docs/design.md §2, issue 6).

- :mod:`server.training.tasks`     offline generator of three agent tasks over one shared context
- :mod:`server.training.dataset`   JSONL rows checked (errors name line and field), laid out, batched
- :mod:`server.training.split`     the split forward: base < IP (no grad), module >= IP
- :mod:`server.training.trainer`   ``finetune(FinetuneConfig)``: LoRA or full, checkpoints, manifest
- :mod:`server.training.evaluate`  greedy answers of several arms over one shared prefill, scoring
- :mod:`server.training.command`   the ``agentshare finetune`` command

>>> from server.training import FinetuneConfig
>>> FinetuneConfig(base="m", data="d.jsonl", output="o", name="a").cache_conditioned
True
"""

from server.training.dataset import DataError, Example, read_jsonl
from server.training.tasks import Difficulty, generate, score
from server.training.trainer import FamilyMismatch, FinetuneConfig, FinetuneResult, finetune

__all__ = ["DataError", "Difficulty", "Example", "FamilyMismatch", "FinetuneConfig",
           "FinetuneResult", "finetune", "generate", "read_jsonl", "score"]
