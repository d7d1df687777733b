"""Rotary position embeddings (RoPE) of the Llama family, from the config's rope parameters.

Frequencies ``inv_freq[i] = theta ** (-2i / head_dim)``, optionally rescaled:

=========== ==================================================================================
kind        rescaling
=========== ==================================================================================
default     none
linear      ``inv_freq / factor``
llama3      Llama 3.1's band-wise rule: long wavelengths / factor, short ones kept, a smooth
            ramp between ``low_freq_factor`` and ``high_freq_factor``
=========== ==================================================================================

Other kinds (yarn, dynamic NTK, longrope, ...) raise :class:`UnsupportedRopeError` rather than
silently computing different positions. Rotation uses the "rotate half" layout of transformers'
Llama (dimension ``i`` pairs with ``i + head_dim/2``).

>>> rope = Rope.from_config_dict({"rope_type": "default", "rope_theta": 10000.0}, head_dim=8)
>>> cos, sin = rope.cos_sin(torch.arange(3), torch.float32)
>>> tuple(cos.shape), float(cos[0, 0]), float(sin[0, 0])
((3, 8), 1.0, 0.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


class UnsupportedRopeError(ValueError):
    """The config asks for a RoPE variant the engine does not implement."""


@dataclass(frozen=True, slots=True)
class Rope:
    inv_freq: torch.Tensor  # [head_dim // 2], fp32
    attention_scaling: float = 1.0
    _on_device: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """``inv_freq`` copied once to each device it is used on (a step copies nothing from the
    host: a CUDA graph could not capture that copy)."""

    @classmethod
    def from_config(cls, config: object, head_dim: int) -> Rope:
        """Read ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x)."""
        params: dict[str, Any] = dict(getattr(config, "rope_parameters", None) or {})
        if not params:
            params = dict(getattr(config, "rope_scaling", None) or {})
            params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        if "original_max_position_embeddings" not in params and hasattr(
            config, "original_max_position_embeddings"
        ):
            params["original_max_position_embeddings"] = config.original_max_position_embeddings
        return cls.from_config_dict(params, head_dim=head_dim)

    @classmethod
    def from_config_dict(cls, params: dict[str, Any], *, head_dim: int) -> Rope:
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedRopeError("partial rotary embeddings are not supported")
        theta = float(params.get("rope_theta", 10000.0))
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        if kind == "default":
            pass
        elif kind == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_scaling(inv_freq, params)
        else:
            raise UnsupportedRopeError(
                f"rope type {kind!r} is not supported by the engine (supported: default, linear, llama3)"
            )
        return cls(inv_freq=inv_freq)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions`` ([T]) as [T, head_dim], computed in fp32, cast to ``dtype``."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and the *signed* sin ``[-sin_low | sin_high]`` that :func:`apply_rope` takes,
        once per step for every layer."""
        cos, sin = self.cos_sin(positions, dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] by the per-token tables of :meth:`Rope.tables` [T, head_dim].

    transformers computes ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x_high |
    x_low]``; ``roll(x, half) * [-sin_low | sin_high]`` is the same products (a sign flip is
    exact), in fewer ops and without a concatenated copy of ``x``.

    >>> rope = Rope.from_config_dict({"rope_theta": 10000.0}, head_dim=4)
    >>> cos, sin = rope.tables(torch.tensor([1]), torch.float32)
    >>> x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    >>> c, s = rope.cos_sin(torch.tensor([1]), torch.float32)
    >>> torch.equal(apply_rope(x, cos, sin), x * c + torch.cat((-x[..., 2:], x[..., :2]), -1) * s)
    True
    """
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + x.roll(half, dims=-1) * signed_sin[:, None, :]


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    try:
        factor = float(params["factor"])
        low = float(params["low_freq_factor"])
        high = float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
    except KeyError as exc:
        raise UnsupportedRopeError(f"llama3 rope scaling needs {exc.args[0]!r}") from exc
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    # long wavelengths (low frequencies) are interpolated, short ones kept as they are
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, ramp, scaled)
