"""Rotary position embeddings: default, linear, dynamic (NTK), llama3 and yarn.

:func:`inv_freq` reproduces transformers' ``ROPE_INIT_FUNCTIONS`` (and
``LlamaRotaryEmbedding.compute_default_rope_parameters``) operation for
operation, so the inverse frequencies and the cos/sin scale match bit for bit.
Rotation uses the rotate-half (NeoX) layout of Hugging Face Llama checkpoints:
dimension ``i`` pairs with ``i + head_dim // 2``.

Dynamic NTK differs from transformers on purpose. transformers recomputes the
base from the longest sequence seen so far, which would leave keys already in
a paged cache rotated with stale frequencies; like vLLM we fix the base once,
at ``seq_len = factor * max_position_embeddings``.
"""

from __future__ import annotations

import math

import torch

from medha_kernels.decode_ops import rotary_ as native_rotary_
from medha_kernels.decode_ops import rotary_tables as native_rotary_tables
from medha_runtime.model.config import RopeConfig


def inv_freq(
    rope: RopeConfig,
    *,
    head_dim: int,
    max_position_embeddings: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (``attention_factor``).

    Args:
        rope: the RoPE parameters.
        head_dim: rotary dimension (the full head).
        max_position_embeddings: the config's context length.
        seq_len: only for ``dynamic``: the sequence length the base is fit to
            (default, and minimum, ``max_position_embeddings``).

    Returns:
        ``([head_dim // 2] fp32 on the CPU, scale)``.
    """
    base, dim = rope.theta, head_dim
    if rope.rope_type == "dynamic":
        factor = rope.factor
        n = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = base * ((factor * n / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if rope.rope_type in ("default", "dynamic"):
        return freqs, 1.0
    if rope.rope_type == "linear":
        return freqs / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(freqs, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim)
    raise ValueError(f"unknown rope_type {rope.rope_type!r}")


def _llama3(freqs: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Wavelength-based smoothing of Llama 3.1 (transformers ``_compute_llama3_parameters``)."""
    assert rope.low_freq_factor is not None and rope.high_freq_factor is not None
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    assert old_context_len is not None
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (transformers ``_compute_yarn_parameters``)."""
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position_embeddings
    assert orig is not None

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    freqs = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return freqs, float(attention_factor)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (rotate-half layout).

    Args:
        x: ``[num_tokens, num_heads, head_dim]``.
        cos, sin: ``[num_tokens, head_dim // 2]`` in ``x``'s dtype.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``x``'s dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's tables for :func:`apply_rotary_`, built once and shared by every layer.

    Args:
        cos, sin: ``[num_tokens, head_dim // 2]`` (from :meth:`RotaryEmbedding.cos_sin`).

    Returns:
        ``(cos2, sin2)``, each ``[num_tokens, 1, 2, head_dim // 2]``: ``cos`` for both
        halves (a broadcast view), and ``(-sin, sin)``.
    """
    cos2 = cos.unsqueeze(1).unsqueeze(1).expand(-1, 1, 2, -1)
    sin2 = torch.stack((-sin, sin), dim=1).unsqueeze(1)
    return cos2, sin2


def apply_rotary_(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> None:
    """Rotate ``x`` in place (rotate-half layout): the same arithmetic as :func:`apply_rotary`.

    ``x * [cos, cos] + [x2, x1] * [-sin, sin]``, i.e. transformers'
    ``x * cos + rotate_half(x) * sin``: each product and the sum round once in
    ``x``'s dtype, so the result is bit-identical to :func:`apply_rotary`. Five
    ops per call (a view, the half swap, two products, the sum), whatever the heads;
    for fp32 on the CPU one native call with the same arithmetic
    (:func:`medha_kernels.decode_ops.rotary_`).

    Args:
        x: ``[num_tokens, num_heads, head_dim]``, any strides with a contiguous
            last dimension (e.g. the q and k heads of a fused QKV output); written.
        cos2, sin2: from :func:`rotary_tables`, in ``x``'s dtype.
    """
    if native_rotary_(x, cos2, sin2):  # fp32 on the CPU: one native call, the same bits
        return
    n, h, d = x.shape
    halves = x.view(n, h, 2, d // 2)
    swapped = halves.flip(2)  # [x2, x1], a new tensor
    swapped.mul_(sin2)
    halves.mul_(cos2).add_(swapped)


class RotaryEmbedding:
    """cos/sin for absolute positions, computed on the fly (no per-device state).

    Args:
        rope: the RoPE parameters.
        head_dim: per-head size.
        max_position_embeddings: the config's context length.
    """

    def __init__(self, rope: RopeConfig, *, head_dim: int, max_position_embeddings: int) -> None:
        self.rope = rope
        self.head_dim = head_dim
        fit = None
        if rope.rope_type == "dynamic":
            fit = int(rope.factor * max_position_embeddings)
        self.inv_freq, self.scale = inv_freq(
            rope, head_dim=head_dim, max_position_embeddings=max_position_embeddings, seq_len=fit
        )
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"RotaryEmbedding(type={self.rope.rope_type}, head_dim={self.head_dim})"

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for each position.

        Args:
            positions: ``[num_tokens]`` integer positions.
            dtype: of the result (computed in fp32, scaled, then cast, as transformers does).

        Returns:
            ``(cos, sin)``, each ``[num_tokens, head_dim // 2]``.
        """
        inv = self._on_device.get(positions.device)
        if inv is None:
            inv = self._on_device[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * inv
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        if cos.dtype == dtype:  # no cast to make (each .to would still be a dispatched op)
            return cos, sin
        return cos.to(dtype), sin.to(dtype)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's ``(cos2, sin2)`` for :func:`apply_rotary_`: ``rotary_tables(*cos_sin(
        positions, dtype))``, for fp32 on the CPU in one native call with the same bits
        (:func:`medha_kernels.decode_ops.rotary_tables`)."""
        if dtype is torch.float32:
            inv = self._on_device.get(positions.device)
            if inv is None:
                inv = self._on_device[positions.device] = self.inv_freq.to(positions.device)
            made = native_rotary_tables(positions, inv, self.scale)
            if made is not None:
                return made
        return rotary_tables(*self.cos_sin(positions, dtype))

    def cos_sin_cache(
        self, num_positions: int, *, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 tables ``[num_positions, head_dim // 2]`` for positions ``0..num_positions-1``."""
        return self.cos_sin(torch.arange(num_positions, device=device))

    def apply_rope(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [N, Hq, D]`` and ``k [N, Hkv, D]`` by their tokens' ``positions [N]``."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
