"""ds_train.observe.startup: a rank's start-up, phase by phase, from its process's creation."""

from __future__ import annotations

import time

from ds_train.observe.startup import StartupClock, process_started


def test_phases_run_from_the_process_start_in_order_and_a_phase_marked_twice_adds_up():
    clock = StartupClock(started=100.0)
    for phase, at in (("imports", 106.0), ("inputs", 107.5), ("model", 110.0), ("inputs", 111.0),
                      ("engine", 114.0)):
        clock.mark(phase, now=at)
    assert clock.phases() == {"imports": 6.0, "inputs": 2.5, "model": 2.5, "engine": 3.0}
    assert clock.total_s() == 14.0 and not clock.finished
    clock.finish("first step")
    first = clock.marks[-1]
    assert clock.finished and not clock.finish("first step") and clock.marks[-1] == first  # once only
    assert clock.said().startswith(f"start-up: {clock.total_s():.1f} s to the end of the first step: imports 6.0, "
                                   f"inputs 2.5, model 2.5, engine 3.0, first step ")


def test_a_clock_begins_at_this_process_creation_with_the_imports_every_run_needs():
    import psutil

    started = process_started()
    assert psutil.boot_time() <= started <= time.time()  # this test process's, not the epoch
    clock = StartupClock.begin()
    assert [phase for phase, _ in clock.marks] == ["imports"] and clock.started == started
    assert StartupClock(started=0.0).total_s() == 0.0 and StartupClock(started=5.0).phases() == {}
