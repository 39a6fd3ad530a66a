"""kernels: tensors in, tensors out. Imports nothing else of the project.

Each kernel module holds the PyTorch reference that defines what it computes,
the Triton kernel, and one public function that dispatches between them
(CUDA tensors -> Triton, CPU tensors -> reference).

Without a GPU, Triton kernels can only run under its interpreter, which must
be chosen before a kernel is defined: so on such machines importing this
package sets TRITON_INTERPRET=1 unless the environment already says otherwise.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.errors import HiltError  # noqa: E402
from kernels.fp8_attention import attention_reference, fp8_attention
from kernels.lut_matmul import byte_table, dequantize_lut, lut_matmul, uses_byte_table  # noqa: E402
from kernels.packing import pack_codes, packed_row_bytes, unpack_codes  # noqa: E402

__all__ = [
    "HiltError", "attention_reference", "byte_table", "dequantize_lut", "fp8_attention", "lut_matmul", "pack_codes",
    "packed_row_bytes", "unpack_codes", "uses_byte_table",
]
