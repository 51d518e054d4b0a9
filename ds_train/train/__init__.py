"""Training: the loop of `ds-train train` (loop), what it measures (meters), the loss exact across
layouts (losses), preference losses (preference) and the frozen reference model (reference) that RIPT's
KL term and DPO share.

It may import the run machinery (ds_train.run) and everything below it; only the CLI's commands import it.
"""
