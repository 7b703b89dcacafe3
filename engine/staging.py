"""Host arrays to the device without waiting for it: through pinned staging memory on CUDA (the copy is
enqueued on the current stream; the caching host allocator keeps the staging block until it is done),
as they are on the CPU. A step's arrays go up together (upload_all): each copy costs the host tens of
microseconds whatever its size, and a small model's decode step waits on the host (benchmarks/NOTES.md)."""
import functools

import numpy as np
import torch

ALIGN = 16  # bytes: Triton specialises its kernels on pointer alignment, so a misaligned array would compile
# another variant mid-run


def upload(array: np.ndarray, device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else tensor


def upload_all(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """Arrays of any dtypes and shapes in one copy: packed as bytes into one buffer, each from an ALIGN-byte
    boundary, and handed back as views of the copy with their own dtype and shape (on the CPU, views of the
    packed host buffer). The copy is viewed once per dtype and sliced once per array: each torch view costs
    the host microseconds."""
    offsets, end = [], 0
    for array in arrays:
        offsets.append(end)
        end += -(-array.nbytes // ALIGN) * ALIGN
    packed = np.empty(max(end, ALIGN), dtype=np.uint8)  # never empty: an empty byte tensor has no typed view
    for array, offset in zip(arrays, offsets):
        packed[offset:offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    on_device, typed, views = upload(packed, device), {}, []
    for array, offset in zip(arrays, offsets):
        if array.dtype not in typed:
            typed[array.dtype] = on_device.view(_torch_dtype(array.dtype))
        start = offset // array.itemsize
        flat = typed[array.dtype][start:start + array.size]
        views.append(flat if array.ndim == 1 else flat.view(array.shape))
    return views


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def aligned_rows(rows: list, dtype) -> np.ndarray:
    """Equal-length rows as a [len(rows), width] array of dtype, width the length rounded up to a multiple of 4
    (zeros after it): in a 16-byte aligned copy, each row of 4- or 8-byte values then starts 16-byte aligned."""
    length = len(rows[0])
    table = np.zeros((len(rows), -(-length // 4) * 4), dtype=dtype)
    table[:, :length] = rows
    return table
