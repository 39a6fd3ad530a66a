"""Lowering a QuantizedWeight to ONNX: the packed codes, codebook and block scales stay
compact as initializers, and a small subgraph of standard operators rebuilds the weight:

    codes (N, R) uint8 --BitShift/BitwiseAnd--> bits --Reshape, Mul 2^i, ReduceSum--> code (N, K)
    codebook[code] (Gather, or GatherElements for per-block codebooks)
    * scales (Cast bf16->float, one per block)  (+ offsets)  -> W (N, K) float32

Every input of the subgraph is a constant, so ONNX Runtime folds it once when the session
is created: the file keeps the quantized size, inference runs the float graph.
(Opset 18+: BitwiseAnd.)
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from hilt.quant.qweight import QuantizedWeight


def _initializer(name: str, t: torch.Tensor) -> onnx.TensorProto:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: raw little-endian 16-bit words
        proto = helper.make_tensor(name, TensorProto.BFLOAT16, list(t.shape), t.contiguous().view(torch.int16).numpy()
                                   .tobytes(), raw=True)
        return proto
    return numpy_helper.from_array(t.contiguous().numpy(), name)


def dequantize_subgraph(name: str, q: QuantizedWeight) -> tuple[list[onnx.TensorProto], list[onnx.NodeProto]]:
    """(initializers, nodes) whose output tensor ``name`` is q.dequantize() as float32, shape (N, K)."""
    n, k = q.shape
    b, block = q.bits, q.block_size
    p = f"{name}__"  # prefix of every intermediate name
    inits = [_initializer(f"{name}.codes", q.codes), _initializer(f"{name}.codebook", q.codebook),
             _initializer(f"{name}.scales", q.scales),
             numpy_helper.from_array(np.arange(8, dtype=np.uint8), p + "shifts"),
             numpy_helper.from_array(np.array(1, dtype=np.uint8), p + "one"),
             numpy_helper.from_array(np.array([n, -1, b], dtype=np.int64), p + "by_code"),
             numpy_helper.from_array((1 << np.arange(b, dtype=np.int64)), p + "place"),
             numpy_helper.from_array(np.array([-1], dtype=np.int64), p + "last"),
             numpy_helper.from_array(np.array([0], dtype=np.int64), p + "zero"),
             numpy_helper.from_array(np.array([k], dtype=np.int64), p + "k"),
             numpy_helper.from_array(np.array([n, k // block, block], dtype=np.int64), p + "blocks"),
             numpy_helper.from_array(np.array([n, k], dtype=np.int64), p + "shape")]
    nodes = [
        # each byte -> its 8 bits, lowest first; consecutive b bits (LSB first) form one code
        helper.make_node("Unsqueeze", [f"{name}.codes", p + "last"], [p + "bytes"]),
        helper.make_node("BitShift", [p + "bytes", p + "shifts"], [p + "shifted"], direction="RIGHT"),
        helper.make_node("BitwiseAnd", [p + "shifted", p + "one"], [p + "bits"]),
        helper.make_node("Cast", [p + "bits"], [p + "bits64"], to=TensorProto.INT64),
        helper.make_node("Reshape", [p + "bits64", p + "by_code"], [p + "code_bits"]),
        helper.make_node("Mul", [p + "code_bits", p + "place"], [p + "weighted"]),
        helper.make_node("ReduceSum", [p + "weighted", p + "last"], [p + "padded"], keepdims=0),
        helper.make_node("Slice", [p + "padded", p + "zero", p + "k", p + "last"], [p + "code"]),  # row padding off
    ]
    if q.codebook.ndim == 1:
        nodes.append(helper.make_node("Gather", [f"{name}.codebook", p + "code"], [p + "levels"]))
        nodes.append(helper.make_node("Reshape", [p + "levels", p + "blocks"], [p + "levels_b"]))
    else:
        nodes.append(helper.make_node("Reshape", [p + "code", p + "blocks"], [p + "code_b"]))
        nodes.append(helper.make_node("GatherElements", [f"{name}.codebook", p + "code_b"], [p + "levels_b"], axis=2))
    nodes += [
        helper.make_node("Cast", [p + "levels_b"], [p + "levels_f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", [f"{name}.scales"], [p + "scales_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", [p + "scales_f", p + "last"], [p + "scales_b"]),
        helper.make_node("Mul", [p + "levels_f", p + "scales_b"], [p + "scaled"]),
    ]
    out = p + "scaled"
    if q.offsets is not None:
        inits.append(_initializer(f"{name}.offsets", q.offsets))
        nodes += [helper.make_node("Cast", [f"{name}.offsets"], [p + "offsets_f"], to=TensorProto.FLOAT),
                  helper.make_node("Unsqueeze", [p + "offsets_f", p + "last"], [p + "offsets_b"]),
                  helper.make_node("Add", [out, p + "offsets_b"], [p + "shifted_w"])]
        out = p + "shifted_w"
    nodes.append(helper.make_node("Reshape", [out, p + "shape"], [name]))
    return inits, nodes


def replace_initializers(model: onnx.ModelProto, weights: dict[str, QuantizedWeight]) -> onnx.ModelProto:
    """Swap the float initializers named in ``weights`` for their compact subgraphs (in place).
    Every name must be an initializer of the graph: a mismatch is a bug in the caller's naming."""
    graph = model.graph
    by_name = {init.name: init for init in graph.initializer}
    missing = [name for name in weights if name not in by_name]
    if missing:
        raise KeyError(f"not initializers of the exported graph: {', '.join(missing[:5])}")
    new_nodes = []
    for name, q in weights.items():
        graph.initializer.remove(by_name[name])
        inits, nodes = dequantize_subgraph(name, q)
        graph.initializer.extend(inits)
        new_nodes += nodes
    # the subgraphs only read initializers: put them first so the graph stays topologically sorted
    old = list(graph.node)
    del graph.node[:]
    graph.node.extend(new_nodes + old)
    return model
