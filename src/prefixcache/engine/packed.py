"""A built model's tensors by name, and back: what the weight cache stores.

`packed_tensors` lists every tensor a quantized `LlamaModel` runs on (its parameters, each
int4 projection's packed codes, bf16 scale/zero pairs and `W'`, the int4 head's planes and
norms, or the packed head's and embedding's GGUF blocks and type); `load_packed` puts them
into a fresh model of the same config, after checking that every name, dtype and shape is
one that model expects.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from prefixcache.engine.int4_head import Int4Head
from prefixcache.engine.models.llama import _PROJECTIONS, LlamaModel
from prefixcache.engine.quant import GROUP_SIZE, KERNEL_DTYPE, Int4Linear
from prefixcache.engine.weight_types import PackedWeight
from prefixcache.engine.weight_types.formats import weight_type
from prefixcache.engine.weight_types.linear import PackedLinear

_HEAD_NORMS = ("norm", "error_norm", "plane_norms")


class PackedMismatch(ValueError):
    """Stored tensors that do not fit the model they are loaded into."""


def packed_tensors(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Every tensor `model` computes with, by name (the tied head's matrix only once)."""
    out = {name: p.detach() for name, p in model.named_parameters()}
    for i, layer in enumerate(model.layers):
        for attr in _PROJECTIONS:
            linear = getattr(layer, attr)
            if isinstance(linear, Int4Linear):
                out.update(_linear_tensors(f"layers.{i}.{attr}.", linear))
            elif isinstance(linear, PackedLinear):
                out.update(_blocks_tensors(f"layers.{i}.{attr}.", linear.weight))
    head_weight = model.head.weight if isinstance(model.head, PackedLinear) else None
    if model.embedding is not None and model.embedding is not head_weight:  # tied: once
        out.update(_blocks_tensors("embedding.", model.embedding))
    if isinstance(model.head, Int4Head):
        out.update(_linear_tensors("head.planes.", model.head.planes))
        out.update({f"head.{n}": getattr(model.head, n) for n in _HEAD_NORMS})
    elif head_weight is not None:
        out.update(_blocks_tensors("head.", head_weight))
    return out


def _blocks_tensors(prefix: str, weight: PackedWeight) -> dict[str, torch.Tensor]:
    """A matrix in its GGUF blocks: the blocks, and the type as a one-value tensor."""
    code = torch.tensor([weight.wtype.code], dtype=torch.int64)
    return {prefix + "blocks": weight.blocks, prefix + "ggml_type": code}


def _linear_tensors(prefix: str, linear: Int4Linear) -> dict[str, torch.Tensor]:
    parts = {"packed": linear.packed, "scales_and_zeros": linear.scales_and_zeros}
    if linear.weight is not None:
        parts["weight"] = linear.weight
    return {prefix + k: v for k, v in parts.items()}


def load_packed(model: LlamaModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Fill a fresh `model` from `packed_tensors` output; PackedMismatch if anything is off."""
    taken: set[str] = set()
    for i, layer in enumerate(model.layers):
        for attr, (param_name, _) in _PROJECTIONS.items():
            prefix = f"layers.{i}.{attr}."
            param = getattr(layer, param_name)
            if prefix + "packed" in tensors:
                setattr(layer, attr, _linear(tensors, prefix, tuple(param.shape), True, taken))
            elif prefix + "blocks" in tensors:
                setattr(layer, attr, _packed(tensors, prefix, tuple(param.shape), taken))
            else:
                continue
            param.data = torch.empty(0, dtype=param.dtype)
    matrix = (model.config.vocab_size, model.config.hidden_size)
    emptied = set()  # parameters whose packed blocks replaced them: stored empty
    if "embedding.blocks" in tensors:
        model.embedding = _packed(tensors, "embedding.", matrix, taken).weight
        emptied.add("embed_tokens")
    head_blocks = "head.blocks" in tensors
    tied_packed = model.lm_head is None and head_blocks and _empty(tensors.get("embed_tokens"))
    if tied_packed:  # the head's blocks are the embedding's too
        emptied.add("embed_tokens")
    if head_blocks and model.lm_head is not None:
        emptied.add("lm_head")
    for name, param in model.named_parameters():
        shape = (0,) if name in emptied else tuple(param.shape)
        param.data = _take(tensors, name, param.dtype, shape, taken)
    if "head.planes.packed" in tensors:
        model.head = _head(model, tensors, taken)
    elif head_blocks:
        model.head = _packed(tensors, "head.", matrix, taken)
        model.embedding = model.head.weight if tied_packed else model.embedding
    if extra := sorted(set(tensors) - taken):
        raise PackedMismatch(f"unexpected tensors {extra[:3]}")


def _take(
    tensors: Mapping[str, torch.Tensor],
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    taken: set[str],
) -> torch.Tensor:
    """`tensors[name]`, if it has this dtype and shape."""
    tensor = tensors.get(name)
    if tensor is None:
        raise PackedMismatch(f"missing tensor {name}")
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        found = f"{tensor.dtype} {tuple(tensor.shape)}"
        raise PackedMismatch(f"{name} is {found}, expected {dtype} {shape}")
    taken.add(name)
    return tensor


def _linear(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    shape: tuple[int, ...],
    dense: bool,
    taken: set[str],
) -> Int4Linear:
    """An `Int4Linear` of a `[out, in]` matrix from its stored parts."""
    out, num_in = shape
    linear = object.__new__(Int4Linear)
    linear.packed = _take(tensors, prefix + "packed", torch.uint8, (out, num_in // 2), taken)
    sz_shape = (num_in // GROUP_SIZE, out, 2)
    linear.scales_and_zeros = _take(
        tensors, prefix + "scales_and_zeros", KERNEL_DTYPE, sz_shape, taken
    )
    linear.weight = (
        _take(tensors, prefix + "weight", torch.float32, shape, taken) if dense else None
    )
    linear.out_features = out
    return linear


def _head(model: LlamaModel, tensors: Mapping[str, torch.Tensor], taken: set[str]) -> Int4Head:
    """The int4 head from its stored planes and norms, on the model's own fp32 matrix."""
    weight = model._head_weight().detach()
    rows = int(tensors["head.planes.packed"].shape[0])
    if weight.dtype != torch.float32 or rows % weight.shape[0] or rows < weight.shape[0]:
        raise PackedMismatch(f"head planes of {rows} rows for a {tuple(weight.shape)} matrix")
    head = object.__new__(Int4Head)
    head.weight = weight
    head.planes = _linear(tensors, "head.planes.", (rows, weight.shape[1]), False, taken)
    head.num_planes = rows // weight.shape[0]
    for name in _HEAD_NORMS:
        norm = _take(tensors, f"head.{name}", torch.float32, (weight.shape[0],), taken)
        setattr(head, name, norm)
    return head


def _packed(
    tensors: Mapping[str, torch.Tensor], prefix: str, shape: tuple[int, ...], taken: set[str]
) -> PackedLinear:
    """A `[out, in]` matrix on its stored GGUF blocks, of the stored type."""
    code = _take(tensors, prefix + "ggml_type", torch.int64, (1,), taken)
    out, num_in = shape
    try:
        wtype = weight_type(int(code[0]), prefix + "blocks")
    except ValueError as error:
        raise PackedMismatch(str(error)) from None
    if num_in % wtype.block_values:
        raise PackedMismatch(f"{prefix}blocks: {wtype.name} rows cannot hold {num_in} weights")
    blocks = _take(tensors, prefix + "blocks", torch.uint8, (out, wtype.row_bytes(num_in)), taken)
    return PackedLinear(PackedWeight(blocks, wtype, (out, num_in), prefix + "blocks"))


def _empty(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.numel() == 0
