"""This process's resources as the operating system and the GPU count them, for the heartbeats and
the reports: memory (RSS; GPU allocated, reserved and utilisation), the OOM kills of its memory
cgroup, and the bytes it has read and written.
"""

from __future__ import annotations

from pathlib import Path


def memory_now(device_index: int | None) -> dict[str, float | None]:
    """RSS; GPU allocated / reserved and utilisation (NVML, through torch) where there is a GPU."""
    import psutil

    out: dict[str, float | None] = {"rss_gib": psutil.Process().memory_info().rss / 2**30}
    if device_index is None:
        return out
    import torch

    out["gpu_allocated_gib"] = torch.cuda.memory_allocated(device_index) / 2**30
    out["gpu_reserved_gib"] = torch.cuda.memory_reserved(device_index) / 2**30
    try:
        out["gpu_util_pct"] = float(torch.cuda.utilization(device_index))
    except Exception:  # no NVML (pynvml) on this machine: utilisation unknown, not an error
        out["gpu_util_pct"] = None
    return out


def oom_kills() -> int:
    """How many processes the kernel's OOM killer ended in this process's memory cgroup (cgroup v2
    memory.events or v1 memory.oom_control); -1 where neither can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return -1
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for base, name in (("/sys/fs/cgroup", "memory.events"), ("/sys/fs/cgroup/memory", "memory.oom_control")):
            if (controllers == "" and name == "memory.events") or "memory" in controllers.split(","):
                for where_ in (Path(base + path) / name, Path(base) / name):
                    try:
                        fields = dict(l.split() for l in where_.read_text().splitlines() if l.strip())
                        return int(fields["oom_kill"])
                    except (OSError, ValueError, KeyError):
                        continue
    return -1


def io_bytes() -> tuple[int, int]:
    """Bytes this process read and wrote (page cache included): a save or load in progress moves."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["rchar"]), int(fields["wchar"])
    except (OSError, ValueError, KeyError):
        return 0, 0
