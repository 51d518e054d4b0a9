"""The model: its Hugging Face config checked (hfconfig.py), its weights checked (weights.py), and
the model built or loaded, under ZeRO-3 partitioned (build.py)."""
