"""ds_train: a thin DeepSpeed trainer for Hugging Face causal LMs (`python -m ds_train --help`)."""

import logging

# bitsandbytes (QLoRA; peft imports it) warns at import, on CPUs with AVX512-BF16, that an optional
# hub kernel is missing ("... No module named 'kernels'") and uses its own: a line in every rank's
# console that says nothing about the run (and that `ds-train doctor` would read as a missing module).
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
