"""Host arrays to the device without waiting for it: through pinned staging memory on CUDA (the copy is
enqueued on the current stream; the caching host allocator keeps the staging block until it is done),
as they are on the CPU."""
import numpy as np
import torch


def upload(array: np.ndarray, device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else tensor


def upload_rows(rows: list[np.ndarray], device) -> list[torch.Tensor]:
    """Arrays of one length and dtype in one copy, as rows of a [len(rows), width] array whose width is
    padded so that each row starts 16-byte aligned (Triton specialises its kernels on pointer alignment:
    a misaligned row would compile another variant mid-run)."""
    per_16 = max(1, 16 // rows[0].itemsize)
    n = len(rows[0])
    packed = np.zeros((len(rows), -(-n // per_16) * per_16), dtype=rows[0].dtype)
    packed[:, :n] = rows
    return list(upload(packed, device)[:, :n])
