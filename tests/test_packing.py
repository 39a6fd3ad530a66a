import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hilt.errors import HiltError
from hilt.kernels import pack_codes, packed_row_bytes, unpack_codes


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(1, 5), cols=st.integers(1, 70), seed=st.integers(0, 2**31))
def test_round_trip_is_bit_exact(bits, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=g)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, packed_row_bytes(cols, bits))
    assert torch.equal(unpack_codes(packed, bits, cols), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_packed_size_is_bits_per_code(bits):
    # 64 codes fill exactly 64 * bits / 8 bytes: no waste for whole groups
    assert packed_row_bytes(64, bits) == 8 * bits


def test_documented_layout():
    # 4 bits: code i of a byte at bit 4 * i (LSB first)
    assert pack_codes(torch.tensor([[1, 2]]), 4).tolist() == [[0x21]]
    # 1 bit: 8 codes per byte, first code in the lowest bit
    assert pack_codes(torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1]]), 1).tolist() == [[0x81]]
    # 3 bits: 8 codes in 3 bytes, little-endian 24-bit group
    codes = torch.tensor([[7, 0, 0, 0, 0, 0, 0, 5]])  # 7 | 5 << 21
    value = 7 | (5 << 21)
    assert pack_codes(codes, 3).tolist() == [[value & 0xFF, (value >> 8) & 0xFF, value >> 16]]


def test_rejects_codes_that_do_not_fit():
    with pytest.raises(HiltError, match="does not fit in 2 bits"):
        pack_codes(torch.tensor([[4]]), 2)
    with pytest.raises(HiltError, match="between 1 and 8"):
        pack_codes(torch.tensor([[0]]), 9)
