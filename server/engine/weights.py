"""Weights of a Llama-family model, in the layout the engine's forward wants.

Supported: ``llama`` (SmolLM2, Llama 2/3), ``mistral``, ``qwen2`` (q/k/v biases), ``qwen3``
(per-head q/k RMSNorm). All share one block::

    h ─┬─ RMSNorm ─ qkv ─ RoPE ─ attention ─ o ─(+)─┬─ RMSNorm ─ gate_up ─ SiLU·up ─ down ─(+)─>
       └────────────────────────────────────────────┘└──────────────────────────────────────┘

q/k/v and gate/up are fused into one matrix each (one matmul instead of three / two: fewer
kernel launches per decode step). Projections are named (``"qkv"``, ``"o"``, ``"gate_up"``,
``"down"``, ``"lm_head"``) so a per-row adapter can find the slice it modifies (see
``server.engine.projection``).

>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
>>> w = ModelWeights.from_hf(LlamaForCausalLM(cfg))
>>> w.shape.q_size, w.shape.kv_size, tuple(w.layers[0].qkv.weight.shape)
(32, 16, (64, 32))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from server.engine import vllm_matmul
from server.engine.numerics import cpu_has_native_bf16

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The model's architecture or configuration is outside what the own forward implements."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a Llama-family config the forward needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_context: int  # max_position_embeddings, or the sliding window if that is smaller

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config: object) -> ModelShape:
        c = config
        model_type = getattr(c, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by the own forward "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        act = getattr(c, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
        heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", None)  # type: ignore[attr-defined]
        kv_heads = kv_heads or heads
        if heads % kv_heads:
            raise UnsupportedModelError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads  # type: ignore[attr-defined]
        max_context = int(c.max_position_embeddings)  # type: ignore[attr-defined]
        window = _active_sliding_window(c)
        if window is not None:
            max_context = min(max_context, window)
        return cls(
            model_type=model_type,
            vocab_size=c.vocab_size,  # type: ignore[attr-defined]
            hidden_size=c.hidden_size,  # type: ignore[attr-defined]
            num_layers=c.num_hidden_layers,  # type: ignore[attr-defined]
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(c.rms_norm_eps),  # type: ignore[attr-defined]
            max_context=max_context,
        )


@dataclass(frozen=True, slots=True)
class Linear:
    """``y = x @ weight.T + bias``; weight is [out, in].

    ``packed``: the weight reordered once for oneDNN's bf16 kernels (AMX / AVX512-BF16), see
    :func:`pack_linear`. Packed linears compute through it, 20–35 % faster than ``F.linear`` on
    the default model's shapes; their ``weight`` keeps only its shape and dtype (on the meta
    device), so packing does not double the memory. ``matmul``: the weight packed for oneDNN's
    matmul instead, where the vllm package provides it (:mod:`server.engine.vllm_matmul`).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    matmul: vllm_matmul.OneDnnWeight | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is not None:
            return self.matmul(x, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def kernel(self) -> str:
        """What computes this linear: ``onednn-matmul``, ``onednn-inner-product`` or ``torch``."""
        return "onednn-matmul" if self.matmul is not None else "onednn-inner-product" if self.packed is not None else "torch"


def can_pack(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """oneDNN packing pays where the CPU computes bf16 natively (fp32 keeps ``F.linear``, so the
    fp32 oracle paths are unchanged)."""
    return (
        dtype == torch.bfloat16
        and torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and cpu_has_native_bf16()
    )


def pack_linear(linear: Linear) -> Linear:
    """``linear`` with its weight reordered for oneDNN (the plain weight is released): for its
    matmul where the vllm package provides it (:mod:`server.engine.vllm_matmul`), else for its
    inner product. Only where :func:`can_pack` (bf16 on a CPU with native bf16): elsewhere it
    would not pay, and oneDNN refuses bf16 on CPUs without AVX-512 (AVX2 only).

    >>> lin = Linear(torch.randn(4, 8, dtype=torch.bfloat16))
    >>> x = torch.randn(3, 8, dtype=torch.bfloat16)
    >>> if can_pack(torch.bfloat16):
    ...     packed = pack_linear(lin)
    ...     assert packed.weight.device.type == "meta" and torch.equal(packed(x), lin(x))
    >>> pack_linear(Linear(torch.randn(4, 8)))
    Traceback (most recent call last):
    ValueError: cannot pack a torch.float32 linear on cpu: oneDNN packing needs bf16 on a CPU with native bf16 (can_pack)
    """
    w = linear.weight
    if not can_pack(w.dtype, w.device):
        raise ValueError(
            f"cannot pack a {w.dtype} linear on {w.device}: oneDNN packing needs bf16 on a CPU with native "
            "bf16 (can_pack)"
        )
    meta = torch.empty(w.shape, dtype=w.dtype, device="meta")
    if vllm_matmul.available():  # oneDNN's matmul: faster at decode sizes, the same numbers
        return Linear(meta, linear.bias, matmul=vllm_matmul.pack(w))
    packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1)
    return Linear(meta, linear.bias, packed)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # rows: q (num_heads*head_dim) | k (kv_size) | v (kv_size)
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # rows: gate (intermediate) | up (intermediate)
    down: Linear
    q_norm: torch.Tensor | None = None  # qwen3: RMSNorm over each head's q / k
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class ModelWeights:
    shape: ModelShape
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: Linear  # shares its weight with ``embed`` when the model ties them

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def packed(self) -> ModelWeights:
        """These weights with every linear packed for oneDNN (:func:`pack_linear`); the
        embedding and the norms stay plain tensors."""
        layers = tuple(
            replace(layer, qkv=pack_linear(layer.qkv), o=pack_linear(layer.o),
                    gate_up=pack_linear(layer.gate_up), down=pack_linear(layer.down))
            for layer in self.layers
        )
        return replace(self, layers=layers, lm_head=pack_linear(self.lm_head))

    @classmethod
    def from_hf(
        cls, model: torch.nn.Module, *, dtype: torch.dtype | None = None, pack: bool | None = None,
        device: torch.device | str | None = None,
    ) -> ModelWeights:
        """From a transformers ``*ForCausalLM`` (its tensors are shared when no cast or move is
        needed). ``device``: where the weights go (None: where the model is).

        ``pack``: reorder the linears for oneDNN; ``None`` packs where :func:`can_pack` says it
        pays (bf16 on a CPU with native bf16); ``True`` where it does not raises ``ValueError``.
        """
        state = {k: v.detach() for k, v in model.state_dict().items()}
        weights = cls.from_state_dict(model.config, state, dtype=dtype, device=device)
        if pack is None:
            pack = can_pack(weights.dtype, weights.embed.device)
        return weights.packed() if pack else weights

    @classmethod
    def from_state_dict(
        cls, config: object, state: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> ModelWeights:
        """From a config and a transformers-named state dict (``model.layers.0.self_attn...``),
        cast to ``dtype`` and moved to ``device`` tensor by tensor (None: as they are)."""
        shape = ModelShape.from_config(config)

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)

        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise UnsupportedModelError(f"weight {name!r} missing from the state dict")
            return cast(state[name])

        def opt(name: str) -> torch.Tensor | None:
            return cast(state[name]) if name in state else None

        def fused(prefix: str, parts: tuple[str, ...]) -> Linear:
            weight = torch.cat([get(f"{prefix}.{p}.weight") for p in parts])
            biases = [opt(f"{prefix}.{p}.bias") for p in parts]
            if all(b is None for b in biases):
                return Linear(weight)
            out = [w.shape[0] for w in (get(f"{prefix}.{p}.weight") for p in parts)]
            bias = torch.cat(
                [b if b is not None else weight.new_zeros(n) for b, n in zip(biases, out, strict=True)]
            )
            return Linear(weight, bias)

        def single(name: str) -> Linear:
            return Linear(get(f"{name}.weight"), opt(f"{name}.bias"))

        layers = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}"
            layers.append(
                LayerWeights(
                    input_norm=get(f"{p}.input_layernorm.weight"),
                    qkv=fused(f"{p}.self_attn", ("q_proj", "k_proj", "v_proj")),
                    o=single(f"{p}.self_attn.o_proj"),
                    post_norm=get(f"{p}.post_attention_layernorm.weight"),
                    gate_up=fused(f"{p}.mlp", ("gate_proj", "up_proj")),
                    down=single(f"{p}.mlp.down_proj"),
                    q_norm=opt(f"{p}.self_attn.q_norm.weight"),
                    k_norm=opt(f"{p}.self_attn.k_norm.weight"),
                )
            )
        embed = get("model.embed_tokens.weight")
        tied = bool(getattr(config, "tie_word_embeddings", False))
        lm_head = Linear(embed) if tied else single("lm_head")
        if tuple(layers[0].qkv.weight.shape) != (shape.q_size + 2 * shape.kv_size, shape.hidden_size):
            raise UnsupportedModelError(
                f"q/k/v weights of shape {tuple(layers[0].qkv.weight.shape)} do not match {shape}"
            )
        return cls(shape, embed, tuple(layers), get("model.norm.weight"), lm_head)


def _active_sliding_window(config: object) -> int | None:
    """The attention window if the config enables one (Mistral v0.1, some Qwen2 configs)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if getattr(config, "model_type", "") in ("qwen2", "qwen3") and not getattr(
        config, "use_sliding_window", False
    ):
        return None
    return int(window)
