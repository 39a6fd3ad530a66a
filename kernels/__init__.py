"""kernels: tensors in, tensors out. Imports nothing else of the project.

Each kernel module holds the PyTorch reference that defines what it computes,
the Triton kernel, and one public function that dispatches between them.
"""

from kernels.errors import HiltError
from kernels.lut_matmul import dequantize_lut, lut_matmul
from kernels.packing import pack_codes, packed_row_bytes, unpack_codes

__all__ = ["HiltError", "dequantize_lut", "lut_matmul", "pack_codes", "packed_row_bytes", "unpack_codes"]
