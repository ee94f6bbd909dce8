"""Loop bounds of the sliding-window attention kernels (their Python twins): every visible (query, key)
pair lies in a visited block, the unmasked blocks hold only visible pairs, and the work per block is
bounded by the window (T x W work, not T^2)."""

import math

import pytest

from gdn2.ops.swa.utils import count_key_blocks, count_query_blocks, key_block_range, query_block_range


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32), (64, 128), (128, 64)])
def test_loop_bounds_cover_exactly_the_window(block_m, block_n):
    """Python twins of the in-kernel bounds: every visible (query, key) pair lies in a visited block,
    unmasked blocks hold only visible pairs, and the count of visited blocks depends on the window,
    not on the position (T x W work, not T^2)."""
    for seq_len in (1, 37, 100, 300):
        for window in (None, 1, 5, 16, 33, 64, 1000):
            w = seq_len if window is None else window
            key_cap = math.ceil((min(w, seq_len) + block_m - 1) / block_n) + 1
            for m0 in range(0, seq_len, block_m):
                rows = range(m0, min(m0 + block_m, seq_len))
                lo, a, b, hi = key_block_range(m0, seq_len, window, block_m, block_n)
                visited = set(range(lo, a, block_n)) | set(range(a, b, block_n)) | set(range(b, hi, block_n))
                needed = {j // block_n * block_n for i in rows for j in range(max(0, i - w + 1), i + 1)}
                assert needed <= visited
                assert all(n0 < seq_len for n0 in visited)
                for n0 in range(a, b, block_n):  # interior: no mask needed
                    assert all(0 <= i - j < w for i in rows for j in range(n0, n0 + block_n))
                assert count_key_blocks(m0, seq_len, window, block_m, block_n) == len(visited) <= key_cap
            query_cap = math.ceil((min(w, seq_len) + block_n - 1) / block_m) + 1
            for n0 in range(0, seq_len, block_n):
                cols = range(n0, min(n0 + block_n, seq_len))
                lo, a, b, hi = query_block_range(n0, seq_len, window, block_m, block_n)
                starts = list(range(lo, min(a, hi), block_m)) + list(range(a, b, block_m)) + list(range(b, hi, block_m))
                assert len(starts) == len(set(starts))
                covered = {i for m in starts for i in range(m, m + block_m)}
                needed = {i for j in cols for i in range(j, min(j + w, seq_len))}
                assert needed <= covered
                for m in range(a, b, block_m):
                    assert m + block_m <= seq_len
                    assert all(0 <= i - j < w for i in range(m, m + block_m) for j in cols)
                assert count_query_blocks(n0, seq_len, window, block_m, block_n) == len(starts) <= query_cap
