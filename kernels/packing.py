"""Bit packing of b-bit codes (1 <= b <= 8) into bytes, row by row.

Layout (the on-disk and in-memory contract of every quantized weight):
codes are packed along the last dimension in groups of ``g = 8 / gcd(b, 8)``
codes that fill ``g * b / 8`` whole bytes. Inside a group, code ``i`` occupies
bits ``[i*b, (i+1)*b)`` of a little-endian integer, so for 1, 2 and 4 bits
code ``i`` of a byte sits at bit ``(i % (8/b)) * b`` (LSB first). Each row is
padded with zero codes to a whole number of groups, so rows start on byte
boundaries and a kernel can address row ``n`` directly.
"""

import math

import torch

from hilt.errors import HiltError


def group_layout(bits: int) -> tuple[int, int]:
    """(codes per group, bytes per group) for ``bits``-bit codes."""
    if not 1 <= bits <= 8:
        raise HiltError(f"bits must be between 1 and 8, got {bits}")
    g = math.gcd(bits, 8)
    return 8 // g, bits // g


def packed_row_bytes(n_codes: int, bits: int) -> int:
    """Bytes one packed row of ``n_codes`` codes takes."""
    codes_per_group, bytes_per_group = group_layout(bits)
    return -(-n_codes // codes_per_group) * bytes_per_group


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along the last dim into uint8."""
    codes_per_group, bytes_per_group = group_layout(bits)
    if codes.numel() and int(codes.max()) >= (1 << bits):
        raise HiltError(f"a code does not fit in {bits} bits (max {int(codes.max())})")
    *lead, n = codes.shape
    pad = -n % codes_per_group
    # the narrowest integer that holds a group: 1, 2, 4, 8 bits fill one byte, 3 and 6 bits three
    wide = torch.uint8 if bytes_per_group == 1 else torch.int32 if bytes_per_group <= 3 else torch.int64
    c = codes.to(wide)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*lead, -1, codes_per_group)
    if codes_per_group == 2:  # 4 bits: two codes per byte, OR-ed in place
        return (c[..., 0] | (c[..., 1] << bits)).reshape(*lead, -1)
    if bytes_per_group == 1:  # the codes of a byte hold disjoint bits: their sum fits the byte
        shifts = torch.arange(codes_per_group, dtype=wide, device=c.device) * bits
        return (c << shifts).sum(-1, dtype=wide).reshape(*lead, -1)
    shifts = torch.arange(codes_per_group, dtype=wide, device=c.device) * bits
    group = (c << shifts).sum(-1, dtype=wide)  # at most 56 bits: fits int64
    byte_shifts = torch.arange(bytes_per_group, dtype=wide, device=c.device) * 8
    out = (group.unsqueeze(-1) >> byte_shifts) & 0xFF
    return out.reshape(*lead, -1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n_codes: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 (..., bytes) -> ``dtype`` (..., n_codes), int64 by default
    (what indexing takes)."""
    codes_per_group, bytes_per_group = group_layout(bits)
    *lead, nbytes = packed.shape
    if nbytes != packed_row_bytes(n_codes, bits):
        raise HiltError(
            f"packed rows have {nbytes} bytes but {n_codes} codes of {bits} bits need "
            f"{packed_row_bytes(n_codes, bits)}"
        )
    if bytes_per_group == 1:  # 1, 2, 4, 8 bits: split each byte in uint8, a quarter of int64's memory traffic
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.to(torch.uint8).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return codes.reshape(*lead, -1)[..., :n_codes].to(dtype)
    b = packed.to(torch.int64).reshape(*lead, -1, bytes_per_group)
    byte_shifts = torch.arange(bytes_per_group, dtype=torch.int64, device=b.device) * 8
    group = (b << byte_shifts).sum(-1)
    shifts = torch.arange(codes_per_group, dtype=torch.int64, device=b.device) * bits
    codes = (group.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, -1)[..., :n_codes].to(dtype)
