"""What building a vLLM engine changes in the rank's process, put back when the engine is built: the global
random generators (vLLM seeds them all) and the policy's module classes (vLLM's Transformers backend decorates
Hugging Face's class itself)."""

from __future__ import annotations

import contextlib

from ds_train.benchmarks import kept_generators


def kept_rng():
    """Python's, NumPy's and torch's global generators (every CUDA device's too) as they were before the
    block: building a vLLM engine seeds them all to one value on every rank, over ds_train's per-rank
    seeds and a resumed run's restored state. The same guard as lm_eval's scoring (ds_train/benchmarks.py)."""
    return kept_generators()


@contextlib.contextmanager
def kept_classes(model):
    """The policy's module classes as they were before the block. vLLM serves a model type it has no class of its
    own for through its Transformers backend, which decorates the Hugging Face class itself for torch.compile
    (vllm/model_executor/models/transformers/base.py): its `__init__` then needs vLLM's config and its `__call__`
    an attribute only that `__init__` sets, so the policy built before (OLMo-2, SmolLM3, ...) and any model of
    the class built after (a reference, an export's check) fail. Restored, the engine's own instance runs its
    layers uncompiled (on a CPU they are anyway)."""
    classes = {type(m) for m in model.modules()}
    saved = {cls: {name: cls.__dict__.get(name) for name in ("__init__", "__call__")} for cls in classes}
    try:
        yield
    finally:
        for cls, attrs in saved.items():
            for name, value in attrs.items():
                if cls.__dict__.get(name) is not value:
                    if value is None:
                        delattr(cls, name)
                    else:
                        setattr(cls, name, value)
