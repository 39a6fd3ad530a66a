"""Lowering a QuantizedWeight to ONNX: the packed codes, codebook and block scales stay
compact as initializers, and a small subgraph of standard operators rebuilds the weight:

    codes (N, R) uint8 --BitShift/BitwiseAnd--> bits --Reshape, Mul 2^i, ReduceSum--> code (N, K)
    codebook[code] (Gather, or GatherElements for per-block codebooks)
    * scales (Cast bf16->float, one per block)  (+ offsets)  -> W (N, K) float32

Every input of the subgraph is a constant, so ONNX Runtime folds it once when the session
is created: the file keeps the quantized size, inference runs the float graph.
(Opset 18+: BitwiseAnd.)

Symmetric 2-, 4- and 8-bit integer weights go further (:func:`use_matmulnbits`): the
``Transpose`` + ``MatMul`` that reads the weight becomes ONNX Runtime's ``MatMulNBits``
(domain com.microsoft), which keeps the codes packed in the session and computes
``(c - 2^(bits-1)) * scale`` per block, exactly hilt's level for code c (its codebook is
-2^(bits-1) .. 2^(bits-1) - 1). Its codes are hilt's bytes as they are, one row of blocks per
output; the scales become float32 (exact from bfloat16), the type of the activations.
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


MATMULNBITS_BITS = (2, 4, 8)  # what ONNX Runtime's CPU kernel takes


def matmulnbits_fits(q: QuantizedWeight) -> bool:
    """Whether MatMulNBits computes ``q`` exactly: levels -2^(b-1) .. 2^(b-1)-1 (the default zero point
    2^(bits-1) is then hilt's) with no offsets, 2, 4 or 8 bits, blocks of a power of two from 16 on. The
    stored parts decide, whatever the method that made them."""
    b, block = q.bits, q.block_size
    return (q.offsets is None and q.codebook.ndim == 1 and b in MATMULNBITS_BITS
            and block >= 16 and block & (block - 1) == 0
            and torch.equal(q.codebook.float(), torch.arange(-(1 << (b - 1)), 1 << (b - 1)).float()))


def use_matmulnbits(model: onnx.ModelProto, weights: dict[str, QuantizedWeight]) -> list[str]:
    """Replace each ``Transpose(NAME) -> MatMul(x, .)`` of a weight in ``weights`` that
    :func:`matmulnbits_fits` by one MatMulNBits node reading the packed codes (in place). Returns the
    names replaced; the others are left to :func:`replace_initializers`."""
    graph = model.graph
    by_name = {init.name: init for init in graph.initializer}
    readers: dict[str, list] = {}
    for node in graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    done, drop, swap = [], set(), {}
    for name, q in weights.items():
        transposes = readers.get(name, [])
        if not matmulnbits_fits(q) or name not in by_name or len(transposes) != 1 or transposes[0].op_type != "Transpose":
            continue
        matmuls = readers.get(transposes[0].output[0], [])
        if len(matmuls) != 1 or matmuls[0].op_type != "MatMul" or list(matmuls[0].input)[1] != transposes[0].output[0]:
            continue
        n, k = q.shape
        blocks = k // q.block_size
        codes = q.codes.contiguous().view(n, blocks, q.block_size * q.bits // 8)
        graph.initializer.remove(by_name[name])
        graph.initializer.extend([numpy_helper.from_array(codes.numpy(), f"{name}.codes"),
                                  numpy_helper.from_array(q.scales.float().numpy(), f"{name}.scales")])
        matmul = matmuls[0]
        swap[id(matmul)] = helper.make_node(
            "MatMulNBits", [matmul.input[0], f"{name}.codes", f"{name}.scales"], list(matmul.output),
            name=f"{name}__matmulnbits", domain="com.microsoft", K=k, N=n, bits=q.bits, block_size=q.block_size)
        drop.add(id(transposes[0]))
        done.append(name)
    if done:
        nodes = [swap.get(id(node), node) for node in graph.node if id(node) not in drop]
        del graph.node[:]
        graph.node.extend(nodes)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return done


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
