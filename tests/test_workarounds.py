"""ds_train.model.workarounds: each workaround of DeepSpeed's and transformers' behaviour, and the test that
fails once it is no longer needed (then the workaround goes)."""

from __future__ import annotations

import json
import os

import pytest

MUON_PROBE = """
import json, sys, torch
calls = []
if sys.argv[1] == "deferred":
    from ds_train.model.workarounds import defer_muon_compile
    torch.compile = lambda fn: calls.append(fn.__name__) or fn  # recorded, then the eager function
    first, again = defer_muon_compile(), defer_muon_compile()
else:
    first = again = None
    import deepspeed.runtime.zero.muon.original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon import original_muon as m
inductor = "torch._inductor.compile_fx" in sys.modules
g = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
got = m.zeropower_via_newtonschulz5(g, 5) if sys.argv[1] == "deferred" else None
want = m.zeropower_via_newtonschulz5.__wrapped__(g, 5) if sys.argv[1] == "deferred" else None
print(json.dumps({"first": first, "again": again, "inductor": inductor, "calls": calls,
                  "same": None if got is None else bool(torch.equal(got, want))}))
"""


@pytest.mark.parametrize("how", ["deepspeed", "deferred"])
def test_deepspeeds_muon_module_compiles_at_import_unless_deferred(how):
    """Why defer_muon_compile exists: DeepSpeed's own import of its Muon module (which its ZeRO and bf16
    optimizers make) imports TorchInductor; this fails when it no longer does, and the workaround goes.
    Deferred: nothing compiled at import, each function compiled (torch.compile, recorded here) on its
    first call and giving the eager function's result."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", MUON_PROBE, how], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if how == "deepspeed":
        assert got["inductor"], "DeepSpeed's Muon import no longer compiles: remove workarounds.defer_muon_compile"
    else:
        assert (got["first"], got["again"], got["inductor"]) == (True, False, False)
        assert got["calls"] == ["zeropower_via_newtonschulz5"] and got["same"], got


def test_the_pinned_transformers_registry_takes_autoep_keys_so_the_patch_for_a_newer_one_changes_nothing():
    """Why output_capture_registry_takes_keys exists: DeepSpeed 0.19.8's AutoEP reads and writes transformers'
    output-capture registry by its keys (class names) with a default, which transformers 5.23's registry class
    refuses (it takes a model). The pinned transformers (5.19.0, for vLLM) keeps the registry a plain dict keyed
    by class names, so the workaround leaves it alone. This fails when a transformers with the registry class
    is pinned again: then restore the test of the patch itself (git history) and run the AutoEP tests."""
    import torch
    from transformers.utils import output_capturing

    from ds_train.model.workarounds import output_capture_registry_takes_keys

    assert not hasattr(output_capturing, "_CanRecordRegistry")
    registry, key, missing = output_capturing._CAN_RECORD_REGISTRY, str(torch.nn.Linear), object()
    assert type(registry) is dict
    with output_capture_registry_takes_keys():
        assert registry.get(key, missing) is missing  # DeepSpeed's call, as it makes it
        assert output_capturing._CAN_RECORD_REGISTRY is registry and type(registry) is dict
