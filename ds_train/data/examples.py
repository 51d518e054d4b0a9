"""What the readers of prepared sequences share: the no-target label, the seeded per-epoch order, an
example's target count, writing an example into a row, and the micro-batch of sequences."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


IGNORE = -100  # a position with no target (prompt, padding, an example's last token)


class EpochOrder:
    """Global sample index -> an index into `n` items: epoch sample // n in a seeded permutation of
    its own (the current epoch's cached), or in file order without `shuffle`."""

    def __init__(self, seed: int, n: int):
        self.seed, self.n, self._epoch, self._perm = seed, n, -1, None

    def __call__(self, sample: int, shuffle: bool = True) -> int:
        epoch, i = divmod(sample, self.n)
        if not shuffle:
            return i
        if epoch != self._epoch:
            self._perm, self._epoch = np.random.default_rng([self.seed, epoch]).permutation(self.n), epoch
        return int(self._perm[i])


def target_counts(mask: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Targets each example can learn within its first `lengths` tokens (the whole example, or what
    truncation leaves): a masked token with a token before it in the same example."""
    full = np.diff(offsets)
    targets = np.zeros(len(full), dtype=np.int64)
    if len(mask):
        starts = offsets[:-1][full > 0]
        targets[full > 0] = np.add.reduceat(mask.astype(np.int64), starts) - mask[starts]
        for i in np.flatnonzero(full > lengths):  # truncated: count what is left
            o = offsets[i]
            targets[i] = int(mask[o + 1:o + lengths[i]].sum())
    return targets


def fill_example(data, e: int, inputs: np.ndarray, targets: np.ndarray, at: int) -> int:
    """Example `e` of `data` (its tokens, mask, offsets and kept lengths) written into a row from
    position `at`: its tokens, and the next token as the target where the mask marks it. Its length."""
    o, n = int(data.offsets[e]), int(data.lengths[e])
    inputs[at:at + n] = data.tokens[o:o + n]
    targets[at:at + n - 1] = np.where(data.mask[o + 1:o + n] > 0, data.tokens[o + 1:o + n].astype(np.int64), IGNORE)
    return n


@dataclass(frozen=True)
class Batch:
    """Sequences of instruction data: inputs, aligned targets (IGNORE where no loss) and positions
    (restarting at each packed example; None: one example per sequence, positions from 0)."""
    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray | None

    @property
    def n_targets(self) -> int:
        return int(np.count_nonzero(self.targets != IGNORE))
