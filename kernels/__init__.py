"""hilt.kernels: tensors in, tensors out. Imports nothing else of the project but its error class.

Each kernel has the PyTorch reference that defines what it computes and one public function
that dispatches (``lut_matmul``, ``fp8_attention``): CUDA tensors -> the Triton kernel, CPU
tensors -> the reference. The Triton code lives in ``*_triton`` modules that load only when a
kernel runs (``backends.triton_kernels``), so importing this package does not import Triton,
and machines without Triton (it has Linux wheels only) run the references. To run the Triton
code itself on the CPU (how the tests check it), ``triton_kernels(name, interpret=True)``, or
TRITON_INTERPRET=1 in the environment before those modules are imported.
"""

from hilt.kernels.fp8_attention import E4M3_MAX, attention_reference, fp8_attention
from hilt.kernels.lut_matmul import PackedWeight, byte_table, dequantize_lut, lut_matmul, uses_byte_table
from hilt.kernels.packing import pack_codes, packed_row_bytes, unpack_codes

__all__ = [
    "E4M3_MAX", "PackedWeight", "attention_reference", "byte_table", "dequantize_lut", "fp8_attention", "lut_matmul", "pack_codes",
    "packed_row_bytes", "unpack_codes", "uses_byte_table",
]
