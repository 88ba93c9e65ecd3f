"""Running a GGUF's 4-bit weights natively on the CPU (``EngineConfig.quantized_weights``).

Decoding on a CPU is bound by how many weight bytes each step streams from memory: the
dequantized float32 SmolLM2 is 538 MB a step, its Q4_1 GGUF about 80 MB. llama.cpp runs
the 4-bit weights as they are; so can we. GGUF's Q4_0 and Q4_1 store blocks of 32 weights
as 4-bit integers with a per-block scale (Q4_1 also a minimum): exactly the group-wise
asymmetric int4 format of torch's CPU kernel ``_weight_int4pack_mm_for_cpu``, which
computes ``w = (q - 8) * scale + zero`` per group of 32 along the input dimension. So:

- Q4_1 (``w = d * q + m``): ``scale = d``, ``zero = m + 8 d``;
- Q4_0 (``w = d * (q - 8)``): ``scale = d``, ``zero = 0``.

The kernel takes bfloat16 activations, scales and zeros, so a 4-bit linear layer rounds
its input and the block scales to bfloat16 (everything else stays float32). It is an
approximation of the exact float32 mode, like llama.cpp's own: opt in, never default.

Only decode tokens take the 4-bit path. At the large row counts of a prompt the int4
kernel (bfloat16 arithmetic without AMX) is slower than float32 GEMM, so prompt rows use
the dequantized weights, which are exact. A step's batch is decode-first, so each layer
splits its rows at ``decode_rows``: a token's arithmetic depends only on whether it is a
prompt or a generated token, never on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from libs.model.cpu_linear import pack, packed_linear

GROUP = 32


@dataclass
class Int4Weight:
    """A [N, K] weight as 4-bit integers and per-(row, group) scale and minimum:
    ``w[n, k] = q[n, k] * scale[n, k // 32] + minimum[n, k // 32]``."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K / 32] float32
    minimum: torch.Tensor  # [N, K / 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        g = lambda t: t.repeat_interleave(GROUP, dim=1)  # noqa: E731
        return self.q.float() * g(self.scale) + g(self.minimum)

    def rows(self, index: torch.Tensor) -> "Int4Weight":
        return Int4Weight(self.q[index], self.scale[index], self.minimum[index])

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "minimum")))


def read_q4(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> Int4Weight:
    """Unpack a GGUF Q4_0 / Q4_1 tensor (``raw``: its uint8 blocks, row-major) of ``shape``
    [N, K]. Block layout (ggml): fp16 d, [fp16 m for Q4_1], 16 bytes holding 32 nibbles,
    element j < 16 in the low nibble of byte j and element 16 + j in its high nibble."""
    n, k = shape
    if k % GROUP:
        raise ValueError(f"input dimension {k} is not a multiple of {GROUP}")
    head = {"Q4_0": 2, "Q4_1": 4}[qtype]
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., head:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    if qtype == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = -8.0 * d
    return Int4Weight(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(m))


class Int4Linear(nn.Module):
    """``y = x @ w.T (+ bias)``: the first ``decode_rows`` rows with ``w`` packed for torch's
    int4 CPU kernel, the rest (prompt tokens) with the dequantized float32 weight."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = weight.shape
        self.in_features, self.out_features = k, n
        self.decode_rows = 1 << 62  # set per step by the model; default: every row is 4-bit
        self.register_buffer("dense", weight.dequantize())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1))
        zero = weight.minimum + 8 * weight.scale
        self.register_buffer("scale_zeros", torch.stack([weight.scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.float())
        self.dense_packed: torch.Tensor | None = None  # ``dense`` in oneDNN's layout (pack_dense)

    def pack_dense(self) -> None:
        """Run the prompt rows as the float32 model's packed linears do (libs/model/cpu_linear.py),
        so they stay bit for bit the float32 model's; the unpacked copy is dropped."""
        if self.dense_packed is None:
            self.dense_packed, self.dense = pack(self.dense), None

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dense) if self.dense_packed is None else packed_linear(x, self.dense_packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = min(self.decode_rows, x.shape[0])
        if n == x.shape[0]:
            y = self._int4(x)
        elif n == 0:
            y = self._dense(x)
        else:
            y = torch.cat([self._int4(x[:n]), self._dense(x[n:])])
        return y if self.bias is None else y + self.bias

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scale_zeros).to(x.dtype)

    def _apply(self, fn, recurse=True):  # the packed weights are never cast with the model
        packed, sz = self.packed, self.scale_zeros
        out = super()._apply(fn, recurse)
        self.packed, self.scale_zeros = packed, sz
        return out


class Int8Linear(nn.Module):
    """``y = x @ w.T`` for the LM head in quantized mode: the first ``decode_rows`` rows with
    ``w`` as int8 and a scale per output row (torch's int8 weight-only CPU kernel; the GGUF's
    head is Q8_0, int8 with a scale per 32 weights, and one per row is the nearest format the
    kernel runs), the rest (a prompt's last token) with the float32 weight."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.decode_rows = 1 << 62
        self.dense = weight  # shared with the embedding: no copy
        scale = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127
        q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.dense_packed: torch.Tensor | None = None  # ``dense`` in oneDNN's layout (pack_dense)

    def pack_dense(self) -> None:
        """As ``Int4Linear.pack_dense``; ``dense`` stays (it is the embedding table)."""
        if self.dense_packed is None:
            self.dense_packed = pack(self.dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = min(self.decode_rows, x.shape[0])
        int8 = lambda rows: torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.q, self.scale).to(x.dtype)  # noqa: E731
        dense = lambda rows: torch.nn.functional.linear(rows, self.dense) if self.dense_packed is None else packed_linear(rows, self.dense_packed)  # noqa: E731
        if n == x.shape[0]:
            return int8(x)
        if n == 0:
            return dense(x)
        return torch.cat([int8(x[:n]), dense(x[n:])])

    def _apply(self, fn, recurse=True):  # never cast with the model
        q, scale = self.q, self.scale
        out = super()._apply(fn, recurse)
        self.q, self.scale = q, scale
        return out
