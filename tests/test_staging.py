"""engine/staging.upload_rows: equal-length arrays in one copy keep their values, and each row starts
16-byte aligned (Triton compiles a kernel variant per pointer alignment)."""
import numpy as np
import pytest

from engine.staging import upload_rows


@pytest.mark.parametrize("n", [0, 1, 5, 8])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_upload_rows_keeps_values_and_aligns_rows(n, dtype):
    rows = [np.arange(n, dtype=dtype), np.arange(n, dtype=dtype)[::-1].copy() * 3]
    out = upload_rows(rows, "cpu")
    assert len(out) == 2
    for array, tensor in zip(rows, out):
        assert np.array_equal(tensor.numpy(), array) and tensor.numpy().dtype == dtype
        assert tensor.storage_offset() * tensor.element_size() % 16 == 0
