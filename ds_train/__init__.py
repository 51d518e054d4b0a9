"""ds_train: a thin DeepSpeed trainer for Hugging Face causal LMs (`python -m ds_train --help`)."""
