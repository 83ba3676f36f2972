"""How a weight matrix W [out, in] is stored in 8 or 4 bits, and how it is read back.

int8, per output channel, symmetric: one scale per row, s = max|w_row| / 127, q = round(w / s) in
[-127, 127], w ~ q * s. A zero weight stays exactly zero; the worst error is s / 2 per weight.

int4, group-wise, asymmetric: each row is cut into groups of `group_size` consecutive inputs; a group
stores its minimum and a scale, s = (max - min) / 15, q = round((w - min) / s) in [0, 15], and
w ~ min + q * s. Sixteen levels are too few to waste one side of the range on a skewed group, so the
offset (the "zero point", here the float value of code 0) is worth its bytes. Two codes share a byte:
column 2j in the low nibble, 2j + 1 in the high one. When `in` is not a multiple of `group_size`, the
last group of each row is shorter (it is stored padded with zeros, as the packing needs whole groups).

Bytes per weight: 1 + 4 / in (int8), 0.5 + 8 / group_size (int4, fp32 scale and min per group).
"""
from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)   # what the CPU's int4 kernel accepts; the Triton kernel takes the same


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scales fp32 [out]) with w ~ q * scales[:, None]."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scales.float()[:, None]).to(dtype)


def padded_in(in_features: int, group_size: int) -> int:
    """The input width the int4 format stores: `in_features` rounded up to a whole number of groups."""
    return -(-in_features // group_size) * group_size


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [out, padded_in] in 0..15, scales fp32 [out, groups], mins fp32 [out, groups]).

    Unpacked codes, one per byte: `pack_int4` halves them. Padding columns hold zeros and are never read
    by a product (the input is padded with zeros too)."""
    out_f, in_f = w.shape
    width = padded_in(in_f, group_size)
    w = torch.nn.functional.pad(w.float(), (0, width - in_f))
    groups = w.reshape(out_f, width // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(out_f, width), scales, lo


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, in_features: int,
                    dtype=torch.float32) -> torch.Tensor:
    """W [out, in_features] from unpacked codes (as `quantize_int4` returns them)."""
    out_f, width = codes.shape
    group_size = width // scales.shape[1]
    groups = codes.float().reshape(out_f, -1, group_size)
    w = groups * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(out_f, width)[:, :in_features].to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] codes 0..15 -> uint8 [out, in / 2]: column 2j low nibble, 2j + 1 high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
