"""engine/staging.upload_all: arrays of any dtypes and shapes in one copy keep their values, dtypes and shapes,
and each starts 16-byte aligned (Triton compiles a kernel variant per pointer alignment); aligned_rows
pads each row to a 16-byte start."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.staging import ALIGN, aligned_rows, upload_all

DTYPES = [np.int32, np.int64, np.float32, np.float64, np.bool_, np.uint8]
shapes = st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), shapes, st.booleans()), max_size=6), st.integers(0, 2**31))
def test_upload_all_keeps_values_dtypes_shapes_and_alignment(specs, seed):
    rng = np.random.default_rng(seed)
    arrays = []
    for dtype, shape, transposed in specs:
        array = (rng.integers(-1000, 1000, size=shape) if dtype != np.bool_ else rng.integers(0, 2, size=shape)).astype(dtype)
        arrays.append(array.T if transposed else array)  # a non-contiguous view goes up as its values
    out = upload_all(arrays, "cpu")
    assert len(out) == len(arrays)
    for array, tensor in zip(arrays, out):
        assert tensor.numpy().dtype == array.dtype and tensor.shape == array.shape
        assert np.array_equal(tensor.numpy(), array)
        assert not tensor.numel() or tensor.storage_offset() * tensor.element_size() % ALIGN == 0


def test_aligned_rows_start_each_row_aligned():
    for length in range(1, 9):
        for dtype in (np.int64, np.float32):
            rows = [np.arange(length) + 10 * r for r in range(3)]
            table = upload_all([np.zeros(3, np.int8), aligned_rows(rows, dtype)], "cpu")[1]
            for r in range(3):
                row = table[r, :length]
                assert np.array_equal(row.numpy(), rows[r].astype(dtype))
                assert row.storage_offset() * row.element_size() % ALIGN == 0
