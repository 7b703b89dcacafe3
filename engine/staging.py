"""Host arrays to the device without waiting for it: through pinned staging memory on CUDA (the copy is
enqueued on the current stream; the caching host allocator keeps the staging block until it is done),
as they are on the CPU."""
import numpy as np
import torch


def upload(array: np.ndarray, device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else tensor
