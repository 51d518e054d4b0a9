"""Background saves' parts: the host-memory snapshot and the writers' meetings through a real
rendezvous store (the saves themselves, killed at each phase through the launcher: test_checkpoint.py)."""

from __future__ import annotations

import collections
import threading
import time

import pytest

import torch

from ds_train.dist.store import SideChannel
from ds_train.checkpoint.asyncsave import Abandoned, StoreMeeting, snapshot

Pair = collections.namedtuple("Pair", "a b")


def test_a_snapshot_is_independent_of_training_and_keeps_what_torch_save_would_write(tmp_path):
    flat = torch.arange(12, dtype=torch.float32)
    param = torch.nn.Parameter(torch.ones(3))
    state = collections.OrderedDict(
        first=flat[:6].view(2, 3), second=flat[6:], param=param, step=7, pair=Pair(flat[:2], "x"),
        groups=[{"params": [0, 1], "lr": 0.1}], nested=(flat, {"k": torch.zeros(2, dtype=torch.bfloat16)}))
    copy = snapshot(state)
    flat.add_(100)  # the next steps change the live tensors in place
    param.data.mul_(5)
    state["groups"][0]["lr"] = 0.5
    assert type(copy) is collections.OrderedDict and list(copy) == list(state)
    assert copy["first"].tolist() == [[0, 1, 2], [3, 4, 5]] and copy["second"].tolist() == [6, 7, 8, 9, 10, 11]
    assert isinstance(copy["param"], torch.nn.Parameter) and copy["param"].tolist() == [1, 1, 1]
    assert copy["groups"][0]["lr"] == 0.1 and copy["step"] == 7
    assert type(copy["pair"]) is Pair and copy["pair"].a.tolist() == [0, 1] and copy["pair"].b == "x"
    assert copy["nested"][1]["k"].dtype == torch.bfloat16
    # views of one storage stay views of one copy: the file is as large as torch.save of the live state
    assert copy["first"].untyped_storage().data_ptr() == copy["second"].untyped_storage().data_ptr()
    assert copy["first"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    torch.save(copy, tmp_path / "copy.pt")
    flat.sub_(100)
    param.data.div_(5)
    state["groups"][0]["lr"] = 0.1
    torch.save(state, tmp_path / "live.pt")
    assert (tmp_path / "copy.pt").stat().st_size == (tmp_path / "live.pt").stat().st_size
    loaded = torch.load(tmp_path / "copy.pt", weights_only=False)
    assert torch.equal(loaded["nested"][0], flat) and torch.equal(loaded["param"], param)


def test_writers_meet_share_and_abandon_a_save_through_the_store():
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world = 3
    meetings = [StoreMeeting(SideChannel("127.0.0.1", server.port), 5, r, world) for r in range(world)]
    got, errors = {}, {}

    def writer(rank, fail_at=None):
        m = meetings[rank]
        try:
            m.meet("written")
            if rank == fail_at:
                m.fail(f"rank {rank}: OSError: No space left on device")
                return
            got[rank] = m.share(["step_00000002"] if rank == 0 else None)
            m.meet("durable")
        except Abandoned as e:
            errors[rank] = str(e)

    threads = [threading.Thread(target=writer, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {r: ["step_00000002"] for r in range(world)} and not errors  # rank 0's prune list, everywhere
    meetings = [StoreMeeting(SideChannel("127.0.0.1", server.port), 6, r, world) for r in range(world)]
    threads = [threading.Thread(target=writer, args=(r, 0)) for r in range(world)]  # rank 0's write fails
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)  # nobody waits for a save that cannot complete
    assert errors == {1: "rank 0: OSError: No space left on device", 2: "rank 0: OSError: No space left on device"}
    one = StoreMeeting(None, 1, 0, 1)  # one process: nothing to meet
    one.meet("written")
    assert one.share(["a"]) == ["a"]


@pytest.mark.timeout(30)  # without the check, the meeting waits for the dead rank forever
def test_a_peer_whose_heartbeat_stands_still_is_gone_and_its_save_abandoned():
    """A rank killed after its last collective (its writer outran the training) leaves no collective to
    fail: the others, waiting in the store, stop once its heartbeat there (a watchdog's, republished
    every heartbeat_s) has not changed for gone_s of their own clock, and name it. A peer that is slow
    but beating is waited for, past gone_s."""
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    channel = lambda: SideChannel("127.0.0.1", server.port)  # noqa: E731 (one a thread)
    stop = threading.Event()

    def live_rank(rank: int, seq: int, arrive_after_s: float) -> None:  # its watchdog beats; its writer is late
        ch, n, t0 = channel(), 0, time.monotonic()
        while not stop.is_set():
            ch.set(f"hb/{rank}", f'{{"n": {n}}}')
            n += 1
            if time.monotonic() - t0 > arrive_after_s:
                ch.add(f"ckpt/{seq}/written", 1)
                arrive_after_s = float("inf")
            time.sleep(0.2)

    try:
        channel().set("hb/2", '{"n": 0}')  # rank 2 beat, then its process was killed
        threading.Thread(target=live_rank, args=(1, 7, 0.5), daemon=True).start()
        with pytest.raises(Abandoned, match=r"rank 2's heartbeat stopped \d+ s ago: its process is gone"):
            StoreMeeting(channel(), 7, 0, 3, gone_s=1.5).meet("written")
        threading.Thread(target=live_rank, args=(1, 8, 3.0), daemon=True).start()  # late past gone_s, but beating
        StoreMeeting(channel(), 8, 0, 2, gone_s=1.5).meet("written")  # no Abandoned: it waited for rank 1
        assert channel().add("ckpt/8/written", 0) == 2
    finally:
        stop.set()
