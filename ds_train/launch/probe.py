"""The probe `ds-train launch` runs on every host (`<python> -c PROBE <cwd> <port> <package>...
import:<module>...`, over ssh): the host's Python, the versions of the named packages (null: not
installed), the errors of the named modules that fail to import, working directory,
addresses, the machine's identity (its kernel's boot id with the host name: two hostfile names of
one machine answer the same), a free master port, its GPUs and the CUDA / NCCL versions its torch was
built with, printed as one JSON object. Which packages to ask about is the launching host's choice
(packages.run_packages)."""

PACKAGES = ("ds_train", "deepspeed", "torch")  # the least a run needs; run_packages() derives the full list
PORT_TRIES = 10  # the master port and the next nine

# Port 0 means "not the master".
PROBE = r"""
import importlib.metadata as md, json, os, platform, shutil, socket, subprocess, sys, warnings
cwd, port = sys.argv[1], int(sys.argv[2])
packages = [a for a in sys.argv[3:] if not a.startswith("import:")]
modules = [a[len("import:"):] for a in sys.argv[3:] if a.startswith("import:")]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
def free(p):
    # The rendezvous store binds every interface with SO_REUSEADDR: a listener on any address
    # of this host blocks it, a socket in TIME_WAIT does not.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", p))
            return True
        except OSError:
            return False
def mib(text):
    try:
        return float(text)
    except ValueError:  # [N/A]
        return None
def gpus():
    # nvidia-smi answers from the driver without a CUDA context. Not on PATH: a CPU host.
    if shutil.which("nvidia-smi") is None:
        return [], None
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,driver_version",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return [], f"nvidia-smi failed ({e})"
    said = " ".join((proc.stdout + proc.stderr).split())
    if "No devices were found" in said:  # a driver without devices (exits non-zero): as a CPU host
        return [], None
    if proc.returncode != 0:
        return [], f"nvidia-smi failed (exit {proc.returncode}: {said[-200:]})"
    rows = []
    for line in proc.stdout.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) < 5 or not parts[0].isdigit():
            return [], f"nvidia-smi printed an unreadable line {line!r}"
        rows.append({"index": int(parts[0]), "name": ", ".join(parts[1:-3]), "memory_total_mib": mib(parts[-3]),
                     "memory_used_mib": mib(parts[-2]), "driver": parts[-1]})
    return rows, None
def torch_cuda(listed):
    out = {"torch_cuda": None, "torch_nccl": None, "torch_cuda_available": None, "torch_error": None}
    # The launcher sets CUDA_VISIBLE_DEVICES per slot itself; a login shell's value would only mislead.
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        import torch
        out["torch_cuda"] = torch.version.cuda
        if torch.version.cuda:  # a CPU build has no NCCL to ask
            out["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        if listed and torch.version.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out["torch_cuda_available"] = torch.cuda.is_available()
            if not out["torch_cuda_available"] and caught:
                out["torch_error"] = " ".join(str(caught[-1].message).split())[:300]
    except Exception as e:  # a broken CUDA install is the answer, not a crash of the probe
        out["torch_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return out
def boot_id():
    # Random per kernel boot: two machines never share it, two names of one machine (or containers
    # on one kernel) do. /etc/machine-id is not used: images often ship one fixed id.
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None
def import_errors(modules):
    # Each module the run imports, imported here: an installed package that fails to (a GPU build
    # without its CUDA runtime) is named with its error's last line. After torch_cuda, which clears
    # CUDA_VISIBLE_DEVICES as the launcher would.
    import importlib
    out = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:
            out[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return out
try:
    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
except (OSError, subprocess.SubprocessError):
    addresses = []
listed, gpu_error = gpus()
print(json.dumps({
    "python": sys.executable, "python_version": platform.python_version(),
    "versions": {name: version(name) for name in packages},
    "cwd_exists": os.path.isdir(cwd), "hostname": socket.gethostname(), "boot_id": boot_id(),
    "addresses": addresses,
    "free_port": next((p for p in range(port, port + %(tries)d) if free(p)), None) if port else None,
    "gpus": listed, "gpu_error": gpu_error, **torch_cuda(listed), "import_errors": import_errors(modules)}))
""" % {"tries": PORT_TRIES}
