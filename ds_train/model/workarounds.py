"""Narrow workarounds of DeepSpeed and transformers behaviour around deepspeed.initialize (ds_train/engine.py
applies them), each with the test in tests/test_workarounds.py that fails once it is no longer needed."""

from __future__ import annotations

import contextlib

MUON = "deepspeed.runtime.zero.muon.original_muon"


def defer_muon_compile() -> bool:
    """DeepSpeed 0.19.8's ZeRO-1/2/3 and bf16 optimizers import its Muon module for an isinstance check;
    its `@torch.compile` decorators import TorchInductor on the way: 1.5 CPU-s a rank here, for an
    optimizer ds_train never builds (dsconfig.check_optimizer). Imported here first, each decorator
    compiling on the function's first call: the same functions, compiled as DeepSpeed asks, later. True
    when it imported the module. tests/test_workarounds.py fails once DeepSpeed's import no longer compiles."""
    import functools
    import sys

    import torch
    from deepspeed.runtime import compiler

    def on_first_call(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if call.compiled is None:
                call.compiled = torch.compile(fn)
            return call.compiled(*args, **kwargs)

        call.compiled = None
        return call

    if MUON in sys.modules:
        return False
    eager, compiler.compile = compiler.compile, lambda: on_first_call
    try:
        __import__(MUON)
    finally:
        compiler.compile = eager
    return True


@contextlib.contextmanager
def output_capture_registry_takes_keys(needed: bool = True):
    """DeepSpeed 0.19.8's AutoEP, converting a model's MoE blocks inside deepspeed.initialize, reads and
    writes transformers' output-capture registry by its keys, class names (`registry.get(key, default)`,
    `registry[key] = entry`); transformers 5.23's registry takes a model instead (`get(model)`, keyed by
    its class): a TypeError from deepspeed.initialize, and an entry restored under a wrong key. While
    `needed`, the registry also takes its own keys (a str) as the dict it is; the model form is
    unchanged. Restored after. The pinned transformers (5.19.0, requirements.txt) has the plain dict
    DeepSpeed expects (no _CanRecordRegistry): nothing to do; the patch is for a newer one."""
    from transformers.utils import output_capturing

    registry = getattr(output_capturing, "_CanRecordRegistry", None)
    if not needed or registry is None:
        yield
        return

    get, setitem = registry.get, registry.__setitem__

    def keyed_get(self, model, *default):
        return dict.get(self, model, *default) if isinstance(model, str) else get(self, model, *default)

    def keyed_setitem(self, model, value) -> None:
        if isinstance(model, str):
            dict.__setitem__(self, model, value)
        else:
            setitem(self, model, value)

    registry.get, registry.__setitem__ = keyed_get, keyed_setitem
    try:
        yield
    finally:
        registry.get, registry.__setitem__ = get, setitem
