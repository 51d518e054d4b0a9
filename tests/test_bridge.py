"""The bridge between trainer and rollout ranks (ds_train/dist/bridge.py), two real processes over gloo on one
rendezvous store: a weight stream arrives whole with its version, and one that does not add up (a tensor short, a
tensor changed) is refused; the point-to-point exchange moves each object to its rank only, whatever its size."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import traceback

import pytest

from conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


CASES = ("whole", "short", "changed")


def _side(rank: int, port: int, out) -> None:
    try:
        import torch
        import torch.distributed as tdist

        from ds_train.dist.bridge import Bridge
        from ds_train.topology import DistEnv, Split

        store = tdist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
        split = Split(DistEnv(rank, rank, 2, 2, 0, "127.0.0.1", port, "manual"), 1)  # job rank 1: the rollout rank
        bridge = Bridge(split, store, "gloo", datetime.timedelta(seconds=30))
        weights = [("a.weight", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b.bias", torch.ones(4))]
        if rank == 0:
            for case in CASES:
                if case == "whole":
                    bridge.send_weights(iter(weights), version=7)
                    continue
                name, t = weights[0]  # a stream that does not add up: the sender's record against what it sent
                bridge._broadcast(bridge.node, (name, tuple(t.shape), "float32"), True)
                bridge.node.broadcast(t if case == "short" else t + 1, 0).wait()
                bridge._broadcast(bridge.node, {"end": True, "version": 7, "count": 2 if case == "short" else 1,
                                                "checksum": float(t.double().sum())}, True)
            big = bytes(range(256)) * 4096  # 1 MiB to the rollout rank, nothing back
            got = bridge.exchange({1: {"payload": big}}, [1])
            out.put((rank, "exchange", got[1]))
            out.put((rank, "ok", None))
        else:
            for case in CASES:
                try:
                    received = [(n, t.tolist()) for n, t in bridge.receive_weights()]
                    out.put((rank, case, (received, bridge.received["version"])))
                except RuntimeError as e:
                    out.put((rank, case, str(e)))
            got = bridge.exchange({0: {"small": 1}}, [0])
            out.put((rank, "exchange", len(got[0]["payload"])))
            out.put((rank, "ok", None))
    except Exception:  # noqa: BLE001 - the test reads it
        out.put((rank, "error", traceback.format_exc()))


def test_a_weight_stream_arrives_whole_with_its_version_or_is_refused_and_the_exchange_is_point_to_point():
    """Three streams: whole (the tensors and version 7 arrive), one tensor of two announced, one tensor whose sum
    is not the sender's (both refused); then 1 MiB to the rollout rank and a small object back."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_side, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict = {}
    for _ in range(7):  # rank 0: exchange, ok; rank 1: each stream, exchange, ok
        rank, kind, value = out.get(timeout=90)
        assert kind != "error", value
        got[(rank, kind)] = value
    for p in procs:
        p.join(timeout=30)
    assert got[(1, "whole")] == ([("a.weight", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]), ("b.bias", [1.0] * 4)], 7)
    for case in ("short", "changed"):
        assert "the weights of update 7 arrived incomplete or changed" in got[(1, case)], got
    assert got[(0, "exchange")] == {"small": 1} and got[(1, "exchange")] == 1 << 20
