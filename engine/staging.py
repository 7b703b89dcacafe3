"""Host arrays to the device without waiting for it: through pinned staging memory on CUDA (the copy is
enqueued on the current stream; the caching host allocator keeps the staging block until it is done),
as they are on the CPU. A step's arrays go up together (upload_all): each copy costs the host tens of
microseconds whatever its size, and a small model's decode step waits on the host (benchmarks/NOTES.md)."""
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
    packed host buffer)."""
    offsets, end = [], 0
    for array in arrays:
        offsets.append(end)
        end += -(-array.nbytes // ALIGN) * ALIGN
    packed = np.empty(end, dtype=np.uint8)
    for array, offset in zip(arrays, offsets):
        packed[offset:offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    on_device = upload(packed, device)
    return [_view(on_device, offset, array) for array, offset in zip(arrays, offsets)]


def _view(packed: torch.Tensor, offset: int, array: np.ndarray) -> torch.Tensor:
    dtype = torch.from_numpy(array[:0]).dtype
    if not array.size:  # an empty byte slice cannot be viewed as wider elements (allocates nothing)
        return torch.empty(array.shape, dtype=dtype, device=packed.device)
    return packed[offset:offset + array.nbytes].view(dtype).view(array.shape)
