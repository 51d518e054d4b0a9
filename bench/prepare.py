"""`ds-train prepare` against the tokenizer's raw streaming encode, at two corpus sizes.

    python bench/prepare.py [--sizes-mb 100 400] [--workers 0] [--work /tmp/bench_prepare]

For each size, a JSONL corpus of Python source is generated locally (this Python's standard
library, each file a record, repeated with a distinct header line until the size is reached).
Then, side by side on the same cores:
  raw:     read the JSONL in batches, json.loads, the tokenizer's Rust encode_batch_fast on every
           core (TOKENIZERS_PARALLELISM, RAYON_NUM_THREADS): the tokenizer's own limit, no output;
  prepare: `python -m ds_train prepare CORPUS --tokenizer T --workers N --out DIR`: the same
           tokenizer, streamed through N worker processes, train/val .bin files written.
Each is a subprocess whose peak RSS is the peak of the sum over its process tree (sampled every
50 ms with psutil). Prints a Markdown table (BENCHMARKS.md) and writes results.json to --work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402

RAW = r"""
import json, os, sys, time
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[2]).backend_tokenizer
tokens, batch, start = 0, [], time.monotonic()
with open(sys.argv[1], "rb") as fh:
    for line in fh:
        batch.append(json.loads(line)["text"])
        if len(batch) == 256:
            tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
            batch = []
    tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))
print(json.dumps({"tokens": tokens, "seconds": time.monotonic() - start}))
"""


def make_corpus(path: Path, size_mb: int) -> int:
    """A JSONL corpus of about size_mb MB: stdlib files as records, each copy with its own header."""
    if path.is_file() and path.stat().st_size >= size_mb * 10**6:
        return path.stat().st_size
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(root.rglob("*.py"))[:2000]
             if "test" not in p.parts and p.stat().st_size < 200_000]
    written, copy = 0, 0
    with open(path, "w") as fh:
        while written < size_mb * 10**6:
            for i, text in enumerate(texts):
                line = json.dumps({"text": f"# copy {copy} of file {i}\n{text}"}) + "\n"
                fh.write(line)
                written += len(line)
                if written >= size_mb * 10**6:
                    break
            copy += 1
    return written


def measured(name: str, cmd: list[str], env: dict) -> dict:
    """Run cmd (the `name` side); wall seconds and the peak RSS of its whole process tree."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak, done = 0, threading.Event()

    def sample():
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, err = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        log = cli.saved_output(out + err, name)
        raise cli.fail(f"the {name} side failed (exit {proc.returncode}); its output: {log}")
    return {"seconds": time.monotonic() - start, "peak_rss_mib": peak / 2**20, "stdout": out}


def main() -> None:
    from ds_train.data.meta import META

    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 400])
    ap.add_argument("--workers", type=int, default=0, help="0: one per core")
    ap.add_argument("--work", default="/tmp/bench_prepare")
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cores = args.workers or len(os.sched_getaffinity(0))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": str(cores)}
    py = sys.executable
    tok_data = work / "tokenizer_data"
    if not (tok_data / META).is_file():  # a BPE trained on the stdlib: the tokenizer both sides use
        made = subprocess.run([py, "-m", "ds_train", "prepare", "python-stdlib", "--out", str(tok_data), "--vocab-size",
                               str(args.vocab_size)], env=env, capture_output=True, text=True)
        if made.returncode:
            raise cli.fail(f"preparing the tokenizer's corpus failed (exit {made.returncode}): "
                           f"{(made.stderr.strip().splitlines() or [''])[-1]}")
    tokenizer = str(tok_data / "tokenizer")
    rows = []
    for size in args.sizes_mb:
        corpus = work / f"corpus_{size}mb.jsonl"
        nbytes = make_corpus(corpus, size)
        raw = measured("raw", [py, "-c", RAW, str(corpus), tokenizer], env)
        raw_tokens = json.loads(raw["stdout"])["tokens"]
        out = work / f"prepared_{size}mb"
        prep = measured("prepare", [py, "-m", "ds_train", "prepare", str(corpus), "--tokenizer", tokenizer, "--out",
                                    str(out), "--workers", str(cores), "--overwrite"], env)
        meta = json.loads((out / META).read_text())
        tokens = meta["train_tokens"] + meta["val_tokens"] - meta["train_documents"] - meta["val_documents"]  # no EOS
        assert tokens == raw_tokens, (tokens, raw_tokens)  # the same tokens, both ways
        row = {"size_mb": nbytes / 1e6, "tokens": tokens, "cores": cores,
               "raw_tokens_per_s": raw_tokens / raw["seconds"], "raw_peak_rss_mib": raw["peak_rss_mib"],
               "prepare_tokens_per_s": tokens / prep["seconds"], "prepare_peak_rss_mib": prep["peak_rss_mib"],
               "raw_s": raw["seconds"], "prepare_s": prep["seconds"]}
        row["ratio"] = row["prepare_tokens_per_s"] / row["raw_tokens_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    (work / "results.json").write_text(json.dumps(rows, indent=2))
    print("\n| corpus | tokens | raw encode tok/s (peak RSS) | prepare tok/s (peak RSS) | prepare / raw |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size_mb']:.0f} MB | {r['tokens'] / 1e6:.1f} M | {r['raw_tokens_per_s']:,.0f} "
              f"({r['raw_peak_rss_mib']:.0f} MiB) | {r['prepare_tokens_per_s']:,.0f} ({r['prepare_peak_rss_mib']:.0f} MiB) "
              f"| {r['ratio']:.2f}x |")
    if len(rows) > 1:
        print(f"\npeak RSS of prepare, largest / smallest corpus: "
              f"{rows[-1]['prepare_peak_rss_mib'] / rows[0]['prepare_peak_rss_mib']:.2f}x")


if __name__ == "__main__":
    sys.exit(cli.run(main))
