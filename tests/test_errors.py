"""ds_train/errors.py: which failures are a device out-of-memory (the run then prints its memory
plan's fixes and exits 4)."""

from __future__ import annotations

import torch

from ds_train.errors import is_device_oom


def test_every_form_of_a_failed_device_allocation_is_an_oom_and_nothing_else_is():
    assert is_device_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                                "total capacity of 79.11 GiB of which 1.23 GiB is free."))
    assert is_device_oom(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                                      "reported at some other API call"))
    assert is_device_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_device_oom(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_device_oom(MemoryError("host memory"))  # the host's: not the memory plan's to fix
    assert not is_device_oom(ValueError("CUDA out of memory"))  # only what torch raises
    assert not is_device_oom(None)
