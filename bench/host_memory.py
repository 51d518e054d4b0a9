"""Host memory while ranks load a checkpoint for bf16 training: ds_train's build against the fp32 build.

    python bench/host_memory.py [--hidden 1024 --layers 24] [--nproc 2] [--out FILE.json]

A ~350M Llama (hidden 1024, 24 layers, vocabulary 32,000, untied head) is saved twice, in bf16 (as
models on the hub ship) and in fp32 (as `ds-train export` writes). For each checkpoint and each side,
`--nproc` ranks (the deepspeed launcher) load it for a bf16 ZeRO-2 run at once:

  ds_train  build_model as a run calls it: the model built in the dtype it trains in
  fp32      the same call with an fp32 ds_config (the build before 2026-11-26), then the cast to bf16
            the engine makes at deepspeed.initialize

and then read every weight once, as the engine's move to the device does. Each rank records its RSS
before the build (after the imports) and its peak over the build: all resident memory
(getrusage's ru_maxrss, which counts the checkpoint's memory-mapped pages) and anonymous memory
(RssAnon, sampled every millisecond: what the process itself holds, not the page cache the ranks
share). Printed, and in --out: the largest rank's peaks above its baseline, as multiples of the
model's bf16 bytes (target: at most 1.5x).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402

TARGET = 1.5  # peak above baseline, in the model's bf16 bytes
SIDES = ("ds_train", "fp32")
GIB = 2**30


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class AnonPeak(threading.Thread):
    """The largest RssAnon seen, sampled every millisecond until stopped."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_kib, self.running = status_kib("RssAnon"), True

    def run(self) -> None:
        while self.running:
            self.peak_kib = max(self.peak_kib, status_kib("RssAnon"))
            time.sleep(0.001)

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak_kib, status_kib("RssAnon"))


def worker(ckpt: str, side: str, out: str) -> int:
    """One rank: build the model from `ckpt` for bf16 training as `side` does; its memory to OUT/rank_R.json."""
    import deepspeed  # noqa: F401  (imported before the baseline, as in a run)
    import torch
    from transformers import AutoConfig

    from ds_train.config.model import ModelConfig
    from ds_train.model.build import build_model

    rank = int(os.environ.get("RANK", "0"))
    hf = AutoConfig.from_pretrained(ckpt)
    base_rss, base_anon = status_kib("VmRSS"), status_kib("RssAnon")
    sampler = AnonPeak()
    sampler.start()
    t0 = time.perf_counter()
    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    fp32 = {"zero_optimization": {"stage": 2}}
    model = build_model(ModelConfig(path=ckpt), hf, bf16 if side == "ds_train" else fp32).model
    model.to(torch.bfloat16)  # the engine's cast (a no-op for ds_train's build)
    with torch.no_grad():
        for p in model.parameters():  # the engine's move to the device reads every weight once
            p.sum()
    seconds = time.perf_counter() - t0
    peak_anon = sampler.stop()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    Path(out, f"rank_{rank}.json").write_text(json.dumps({
        "rank": rank, "params": params, "seconds": seconds,
        "rss_above_gib": (peak_rss - base_rss) / 2**20, "anon_above_gib": (peak_anon - base_anon) / 2**20}))
    return 0


def save_checkpoints(hidden: int, layers: int, where: Path) -> dict[str, Path]:
    """The model in bf16 and in fp32 (safetensors), made once per shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dirs = {dtype: where / f"llama_h{hidden}_l{layers}_{dtype}" for dtype in ("bf16", "fp32")}
    if all((d / "config.json").is_file() for d in dirs.values()):
        return dirs
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                               num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=32000,
                               max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(dirs["fp32"])
    model.to(torch.bfloat16).save_pretrained(dirs["bf16"])
    return dirs


def launch(ckpt: Path, side: str, nproc: int, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port",
           str(29500 + os.getpid() % 1000), str(Path(__file__).resolve()), "--worker", str(ckpt), side, str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    if res.returncode:
        log = cli.saved_output(res.stdout + res.stderr, f"{side}_{ckpt.name}")
        raise cli.fail(f"{side} on {ckpt.name}: exit {res.returncode}; its output: {log}")
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(nproc)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:  # a rank (the launcher puts --local_rank=N first)
        return worker(*argv[argv.index("--worker") + 1:][:3])
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "ds_train_bench_host_memory"),
                   help="where the checkpoints are kept between runs")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args(argv)
    dirs = save_checkpoints(args.hidden, args.layers, Path(args.cache))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for ckpt_dtype, ckpt in dirs.items():
            for side in SIDES:
                ranks = launch(ckpt, side, args.nproc, Path(tmp, f"{ckpt_dtype}_{side}"))
                bf16_gib = ranks[0]["params"] * 2 / GIB
                row = {"checkpoint": ckpt_dtype, "side": side, "params": ranks[0]["params"], "bf16_gib": bf16_gib,
                       "rss_above_gib": max(r["rss_above_gib"] for r in ranks),
                       "anon_above_gib": max(r["anon_above_gib"] for r in ranks),
                       "seconds": max(r["seconds"] for r in ranks)}
                row["rss_x_bf16"] = row["rss_above_gib"] / bf16_gib
                row["anon_x_bf16"] = row["anon_above_gib"] / bf16_gib
                results.append(row)
                print(f"{ckpt_dtype} checkpoint, {side:>8} build: peak above baseline (largest of {args.nproc} "
                      f"ranks) RSS {row['rss_above_gib']:.2f} GiB = {row['rss_x_bf16']:.2f}x bf16 bytes, "
                      f"anonymous {row['anon_above_gib']:.2f} GiB = {row['anon_x_bf16']:.2f}x; {row['seconds']:.1f} s",
                      flush=True)
    mine = [r for r in results if r["side"] == "ds_train"]
    print(f"model: {mine[0]['params'] / 1e6:.0f}M parameters, {mine[0]['bf16_gib']:.2f} GiB in bf16; target: "
          f"ds_train's build at most {TARGET}x above baseline: "
          + ", ".join(f"{r['checkpoint']} checkpoint RSS {r['rss_x_bf16']:.2f}x anonymous {r['anon_x_bf16']:.2f}x"
                      for r in mine))
    if args.out:
        Path(args.out).write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                              "nproc": args.nproc, "target": TARGET, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
