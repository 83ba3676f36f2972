"""Chapter 07: weight-only quantization. Fewer bytes per weight, the same FLOPs.

    model = quant.quantize_model(model, "int8")       # or "int4" (group 128), "int4-g32", ...
    LLM(..., quantization="int8")                     # the same, at load time
    quant.linear_weight_bytes(model)                  # what one batch-1 decode step streams

Every `nn.Linear` of the model (q/k/v/o, gate/up/down and the output head) becomes a `QuantLinear`;
embeddings and norms stay as they are (a lookup reads one row per token, a norm vector is tiny). A
tied output head gets its own quantized copy: the embedding is still needed, in full, for the lookup.

Decode at batch 1 reads every weight once per token for ~2 FLOPs each: memory-bound, so a quarter of
the bytes can buy up to 4x (int8 vs fp32). A long prefill does ~2 x tokens FLOPs per weight read:
compute-bound, and there the same layers are no faster, or slower by the dequantisation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.quant.formats import (INT4_GROUP_SIZES, dequantize_int4, dequantize_int8, pack_int4, quantize_int4,
                                     quantize_int8, unpack_int4)
from nanoserve.quant.linear import MATMUL_BACKENDS, QuantLinear

DEFAULT_INT4_GROUP = 128   # torchao's default; chapter 07 measures 32 and 128


@dataclass(frozen=True)
class QuantScheme:
    """"int8" (per-channel, symmetric) or "int4" (group-wise with a min, `group_size` inputs per group)."""
    kind: str
    group_size: int | None = None

    @classmethod
    def parse(cls, spec) -> "QuantScheme | None":
        """None / "none" -> None; "int8"; "int4" (group 128); "int4-g32" / -g64 / -g128 / -g256."""
        if spec is None or isinstance(spec, QuantScheme):
            return spec
        valid = "None, 'int8', 'int4' or 'int4-g<N>' with N in " + "/".join(map(str, INT4_GROUP_SIZES))
        if not isinstance(spec, str):
            raise ValueError(f"quantization = {spec!r}: expected {valid}")
        s = spec.strip().lower()
        if s == "none":
            return None
        if s == "int8":
            return cls("int8")
        if s == "int4":
            return cls("int4", DEFAULT_INT4_GROUP)
        if s.startswith("int4-g") and s[6:].isdigit():
            group = int(s[6:])
            if group not in INT4_GROUP_SIZES:
                raise ValueError(f"quantization = {spec!r}: group size {group} is not supported, expected one of "
                                 f"{', '.join(map(str, INT4_GROUP_SIZES))}")
            return cls("int4", group)
        raise ValueError(f"quantization = {spec!r} is not a known scheme: expected {valid}")

    def __str__(self) -> str:
        return self.kind if self.kind == "int8" else f"int4-g{self.group_size}"


def matmul_backend(device, choice: str | None = None) -> str:
    """The QuantLinear path for a model on `device`: `choice` if given, else from NANOSERVE_KERNELS.

    auto: "aten" on a CPU (PyTorch's int8/int4 ops), "triton" on CUDA (the reference where Triton is
    missing). NANOSERVE_KERNELS=torch means the reference everywhere; triton means the Triton kernels
    (on a CPU, in Triton's interpreter).
    """
    from nanoserve import kernels
    dev = torch.device(device)
    if choice is not None:
        if choice not in MATMUL_BACKENDS:
            raise ValueError(f"quantized matmul backend {choice!r}: expected one of {', '.join(MATMUL_BACKENDS)}")
        if choice == "aten" and dev.type != "cpu":
            raise ValueError(f"quantized matmul backend 'aten' runs PyTorch's CPU ops; the model is on {dev}")
        return choice
    name = kernels.backend(None, dev)
    if name == "triton":
        return "triton"
    if name == "torch":
        return "reference"
    return "aten" if dev.type == "cpu" and _aten_ops_present() else "reference"


def _aten_ops_present() -> bool:
    return all(hasattr(torch.ops.aten, op) for op in ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu",
                                                      "_convert_weight_to_int4pack_for_cpu"))


@torch.no_grad()
def quantize_model(model: nn.Module, quantization, backend: str | None = None) -> nn.Module:
    """Replace every nn.Linear of `model` by a QuantLinear of `quantization`, in place; returns the model.

    backend: see `matmul_backend` (default: chosen for the device the model is on). A layer that cannot
    be stored as asked raises a ValueError naming it, before any layer is replaced.
    """
    scheme = QuantScheme.parse(quantization)
    if scheme is None:
        return model
    device = next(model.parameters()).device
    backend = matmul_backend(device, backend)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not targets:
        raise ValueError("quantize_model: the model has no nn.Linear layer to quantize")
    from nanoserve.quant.linear import check_packable
    for name, m in targets:   # all checked first: a bad layer leaves the model untouched
        check_packable(name, m.out_features, m.in_features, scheme.kind, scheme.group_size, backend)
    for name, m in targets:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, QuantLinear.from_linear(m, scheme.kind, scheme.group_size, backend, name))
    model.quantization = str(scheme)
    return model


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of every linear layer's weight (codes, scales, mins, bias): what a batch-1 decode step reads
    from memory, give or take the embedding row and the norms. Unquantized nn.Linear layers count too."""
    total = 0
    for m in model.modules():
        if isinstance(m, (nn.Linear, QuantLinear)):
            total += sum(t.numel() * t.element_size() for t in list(m.parameters(recurse=False))
                         + list(m.buffers(recurse=False)))
    return total


__all__ = ["QuantScheme", "QuantLinear", "quantize_model", "matmul_backend", "linear_weight_bytes",
           "quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4", "pack_int4", "unpack_int4",
           "INT4_GROUP_SIZES", "MATMUL_BACKENDS", "DEFAULT_INT4_GROUP"]
