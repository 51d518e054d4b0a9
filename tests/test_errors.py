"""ds_train/errors.py: which failures are a device out-of-memory (the run then prints its memory
plan's fixes and exits 4)."""

from __future__ import annotations

import torch

from ds_train.errors import device_oom_said, is_device_oom


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


def test_what_the_allocator_said_is_kept_on_one_line_without_its_advice():
    """torch's OutOfMemoryError as the CUDA caching allocator words it (torch 2.11, c10/cuda/
    CUDACachingAllocator.cpp): the figures stay, the advice about PYTORCH_CUDA_ALLOC_CONF goes."""
    said = device_oom_said(torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 7.81 GiB. GPU 0 has a total capacity of 139.80 GiB of which 5.12 GiB "
        "is free. Including non-PyTorch memory, this process has 134.67 GiB memory in use. Of the allocated memory "
        "131.02 GiB is allocated by PyTorch, and 3.01 GiB is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html"
        "#environment-variables)"))
    assert said.startswith("CUDA out of memory. Tried to allocate 7.81 GiB. GPU 0 has a total capacity of 139.80 GiB")
    assert said.endswith("and 3.01 GiB is reserved by PyTorch but unallocated.") and "\n" not in said
    assert device_oom_said(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be")) == \
        "CUDA error: out of memory CUDA kernel errors might be"


def test_user_code_that_fails_to_load_is_one_line_naming_the_key_the_error_and_its_line(tmp_path, monkeypatch):
    """A verifier or task named `module:attr` whose module has a syntax error, raises (or exits) at
    import, lacks the name, or whose class raises when made: one UserError naming the key, the spec,
    the error and the file and line in the user's code; the original is chained (--debug prints it)."""
    import pytest

    from ds_train.errors import UserError
    from ds_train.ript.tasks import load_object
    from ds_train.ript.verifiers import build_verifier

    (tmp_path / "bad_syntax.py").write_text("def check(c, a, r):\n    return c ==\n")
    (tmp_path / "raises.py").write_text("import json\n\nCONFIG = json.loads('{')\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "fine.py").write_text("class Task:\n    def __init__(self):\n        raise RuntimeError('no data')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [
        (lambda: build_verifier("bad_syntax:check", where="ript.tasks[0].verifier"),
         "ript.tasks[0].verifier: cannot load 'bad_syntax:check': SyntaxError: invalid syntax",
         f"({tmp_path / 'bad_syntax.py'}, line 2)"),
        (lambda: build_verifier("raises:check", where="ript.tasks[1].verifier"),
         "ript.tasks[1].verifier: cannot load 'raises:check': JSONDecodeError: ",
         f"({tmp_path / 'raises.py'}, line 3)"),
        (lambda: build_verifier("exits:check", where="v"), "v: cannot load 'exits:check': SystemExit: 3",
         f"({tmp_path / 'exits.py'}, line 2)"),
        (lambda: build_verifier("fine:missing", where="v"), "v: cannot load 'fine:missing': AttributeError: ", ""),
        (lambda: build_verifier("no_such_module_here:f", where="v"),
         "v: cannot load 'no_such_module_here:f': ModuleNotFoundError: No module named 'no_such_module_here'", ""),
        (lambda: load_object("fine:Task", "ript.tasks"), "ript.tasks: fine:Task() raised RuntimeError: no data",
         f"({tmp_path / 'fine.py'}, line 3)"),
    ]
    for make, start, end in cases:
        with pytest.raises(UserError) as e:
            make()
        said = str(e.value)
        assert said.startswith(start) and said.endswith(end) and "\n" not in said, said
        assert e.value.__cause__ is not None  # the original, for --debug
