"""A linear layer whose weight is stored in 8 or 4 bits, with one matmul path chosen per device.

Which kernel is fast is a property of the kernel and the chip, not of "int8" (chapter 07 measures it):

- "aten" (CPU): PyTorch's own weight-only ops, `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`.
  Their vectorised paths (AVX2, AVX-512) take bf16 activations; with fp32 activations they fall back to
  a scalar loop several times slower than fp32 `F.linear`. So the activation goes in as bf16 and the
  result comes back in the model's dtype: one rounding of the layer's input and output to bf16.
  The int8 op's AVX-512 path reads inputs in blocks of 16 and crashes (a segfault, torch 2.13) when
  `in_features` is not a multiple of 16: the codes are stored padded to 16 columns, the input padded to match.
- "triton" (GPU): `nanoserve.quant.matmul`, which dequantises in registers (our formats).
- "reference": dequantise to the activation's dtype, then `F.linear`. Correct everywhere and slow
  everywhere: it writes and reads back a full-precision copy of the weight on every call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.quant import formats

MATMUL_BACKENDS = ("aten", "triton", "reference")


class QuantLinear(nn.Module):
    """y = x W^T + b with W stored as `scheme` ("int8", or "int4" with `group_size`).

    Build one with `QuantLinear.from_linear(linear, scheme, group_size, backend, name)`; `name` is the
    layer's name in the model, used in error messages.
    """

    def __init__(self, in_features: int, out_features: int, scheme: str, group_size: int | None, backend: str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group_size, self.backend = scheme, group_size, backend
        self.register_buffer("bias", None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, scheme: str, group_size: int | None, backend: str,
                    name: str = "linear") -> "QuantLinear":
        w = linear.weight
        out_f, in_f = w.shape
        check_packable(name, out_f, in_f, scheme, group_size, backend)
        layer = cls(in_f, out_f, scheme, group_size, backend)
        if scheme == "int8":
            q, scales = formats.quantize_int8(w)
            layer.register_buffer("qweight", F.pad(q, (0, layer.padded_in - in_f)))   # zero codes: no effect
            # the CPU op reads its scales in the activation's dtype (bf16); the others keep fp32
            layer.register_buffer("scales", scales.to(torch.bfloat16) if backend == "aten" else scales)
        else:
            codes, scales, mins = formats.quantize_int4(w, group_size)
            if backend == "aten":   # the CPU kernel's own packed layout, and its zero: the value of code 8
                layer.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    codes.to(torch.int32), 1))
                zeros = mins + 8 * scales
                layer.register_buffer("scales_and_zeros", torch.stack((scales, zeros), dim=-1)
                                      .transpose(0, 1).contiguous().to(torch.bfloat16))
            else:
                layer.register_buffer("packed", formats.pack_int4(codes))
                layer.register_buffer("scales", scales)
                layer.register_buffer("mins", mins)
        if linear.bias is not None:
            layer.bias = linear.bias.detach().clone()
        return layer.to(w.device)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        """W [out, in] as the stored codes give it back (the reference path, and the accuracy checks)."""
        if self.scheme == "int8":
            return formats.dequantize_int8(self.qweight[:, :self.in_features], self.scales, dtype)
        if self.backend == "aten":   # recover the codes by running the kernel on the identity
            eye = torch.eye(self.padded_in, dtype=torch.bfloat16, device=self.packed.device)
            return self._aten_int4(eye).t()[:, :self.in_features].to(dtype)
        return formats.dequantize_int4(formats.unpack_int4(self.packed), self.scales, self.mins, self.in_features, dtype)

    @property
    def padded_in(self) -> int:
        """Columns stored: whole int4 groups; int8 on the CPU op, a multiple of 16 (see the module doc)."""
        if self.scheme == "int4":
            return formats.padded_in(self.in_features, self.group_size)
        return formats.padded_in(self.in_features, 16) if self.backend == "aten" else self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "aten":
            lead = x.shape[:-1]
            x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
            if self.padded_in != self.in_features:   # zeros against the padding columns
                x2 = F.pad(x2, (0, self.padded_in - self.in_features))
            if self.scheme == "int8":
                y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
            else:
                y = self._aten_int4(x2)
            y = y.to(x.dtype).reshape(*lead, self.out_features)
        elif self.backend == "triton":
            from nanoserve.quant import matmul
            if self.scheme == "int8":
                return matmul.int8_matmul(x, self.qweight, self.scales, self.bias)
            return matmul.int4_matmul(x, self.packed, self.scales, self.mins, self.group_size, self.bias)
        else:
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        return y if self.bias is None else y + self.bias

    def _aten_int4(self, x_bf16: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x_bf16, self.packed, self.group_size, self.scales_and_zeros)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.scheme == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}{g}, "
                f"backend={self.backend}, bias={self.bias is not None}")


def check_packable(name: str, out_f: int, in_f: int, scheme: str, group_size: int | None, backend: str) -> None:
    """A ValueError naming the layer when its shape cannot be stored or multiplied as asked."""
    if scheme == "int4":
        if group_size not in formats.INT4_GROUP_SIZES:
            raise ValueError(f"{name}: int4 group size {group_size} is not supported: expected one of "
                             f"{', '.join(map(str, formats.INT4_GROUP_SIZES))}")
        if backend == "aten" and out_f % 16:
            raise ValueError(f"{name}: int4 on the CPU kernel needs out_features divisible by 16, this layer has "
                             f"{out_f} (weight [{out_f}, {in_f}]); quantize it with int8 or leave it out")
    if in_f < 1 or out_f < 1:
        raise ValueError(f"{name}: cannot quantize an empty weight [{out_f}, {in_f}]")
