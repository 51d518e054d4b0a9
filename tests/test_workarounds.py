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


def test_transformers_output_capture_registry_takes_its_keys_while_autoep_converts():
    """Why output_capture_registry_takes_keys exists: DeepSpeed 0.19.8's AutoEP reads and writes the registry
    by its keys (class names) with a default, which transformers' registry refuses (it takes a model). This
    fails once transformers takes them again, and the workaround goes. While it applies, the registry is the
    dict it is for a key; a model is looked up as before; afterwards, as before."""
    import torch
    from transformers.utils.output_capturing import _CanRecordRegistry

    from ds_train.model.workarounds import output_capture_registry_takes_keys

    registry, key, missing = _CanRecordRegistry(), str(torch.nn.Linear), object()
    with pytest.raises(TypeError):
        registry.get(key, missing)  # transformers 5.23: get(model) only
    model = torch.nn.Linear(1, 1)
    with output_capture_registry_takes_keys():
        assert registry.get(key, missing) is missing and registry.get(key) is None
        registry[key] = {"router_logits": 0}
        assert registry.get(key) == {"router_logits": 0} == registry.get(model)  # one entry, either way
        registry[torch.nn.Conv1d(1, 1, 1)] = {"x": 1}  # a model: keyed by its class, as transformers keys it
        assert registry.get(str(torch.nn.Conv1d)) == {"x": 1}
    with pytest.raises(TypeError):
        registry.get(key, missing)
    assert registry.get(model) == {"router_logits": 0}
    with output_capture_registry_takes_keys(needed=False):
        with pytest.raises(TypeError):
            registry.get(key, missing)
