"""Local GPU masks for the ``uni`` and ``mp`` backends (a leaf module: only ``_spec`` below it).

Whole GPUs a config declares are handed out as disjoint ``CUDA_VISIBLE_DEVICES`` masks of the
devices this process sees; torch is imported only to count them.
"""

from __future__ import annotations

import os

from workers.executor._spec import ExecutorConfigError

__all__ = ["local_cuda_masks"]


def local_cuda_masks(workers: int, gpus_per_worker: float) -> tuple[str, ...]:
    """Disjoint ``CUDA_VISIBLE_DEVICES`` masks, one per worker, from the locally visible GPUs.

    Raises ``ExecutorConfigError`` for fractional GPUs or when fewer GPUs are
    visible than ``workers * gpus_per_worker``. Imports torch only here.
    """
    if gpus_per_worker != int(gpus_per_worker) or gpus_per_worker < 1:
        raise ExecutorConfigError(
            "ExecutorConfig.gpus_per_worker", gpus_per_worker, "local backends need whole GPUs (>= 1)"
        )
    per = int(gpus_per_worker)
    needed = workers * per
    visible = _visible_devices()
    if len(visible) < needed:
        raise ExecutorConfigError(
            "ExecutorConfig.gpus_per_worker",
            gpus_per_worker,
            f"{workers} worker(s) need {needed} whole local GPU(s) but {len(visible)} are visible; "
            "select backend 'ray' for cluster scheduling",
        )
    return tuple(",".join(visible[rank * per : (rank + 1) * per]) for rank in range(workers))


def _visible_devices() -> list[str]:
    try:
        import torch
    except ImportError:
        return []
    count = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(index) for index in range(count)]
    # Masks name the caller's devices as it sees them, so a rank never escapes the caller's mask.
    names = [part.strip() for part in listed.split(",") if part.strip()]
    return names[:count]
