"""Reading prepared preference pairs (data.format preference): a sample is a pair, both of its
sequences in one micro-batch on one rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_train.data.examples import IGNORE, Batch, EpochOrder, fill_example, target_counts
from ds_train.errors import UserError


@dataclass(frozen=True)
class PairBatch(Batch):
    """Preference pairs: rows 0..m-1 the chosen sequences, m..2m-1 the rejected ones, in pair order,
    as wide as the longest of them; `pairs`: each pair's index in its split (its chosen example is
    2 x pair, its rejected one 2 x pair + 1)."""
    pairs: np.ndarray | None = None


class PreferenceData:
    """Preference pairs (data.format preference): example 2p is pair p's chosen sequence, 2p + 1 its
    rejected one. A sample is a pair: both of its sequences are in one micro-batch on one rank.
    Pairs are drawn in a seeded order per epoch as SftData's sequences are. A pair with a side
    longer than seq_len is dropped or (data.overlong truncate) both sides cut; one with a side left
    without a target token is dropped; both counted in summary()."""

    def __init__(self, data_dir: Path, split: str, dtype: str, seq_len: int, seed: int, overlong: str, pad_id: int):
        self.tokens = np.memmap(data_dir / f"{split}.bin", dtype=np.dtype(dtype), mode="r")
        self.mask = np.memmap(data_dir / f"{split}.mask", dtype=np.uint8, mode="r")
        self.offsets = np.fromfile(data_dir / f"{split}.idx", dtype=np.int64)
        self.seq_len, self.seed, self.pad_id, self.policy = seq_len, seed, pad_id, overlong
        lengths = np.diff(self.offsets)
        if len(lengths) % 2:
            raise UserError(f"{data_dir / f'{split}.idx'}: {len(lengths)} examples, an odd number, so not chosen / "
                            f"rejected pairs (prepared as another format?); prepare it again with data.format "
                            f"preference (data.reprepare=true)")
        self.pairs_total = len(lengths) // 2
        self.lengths = np.minimum(lengths, seq_len) if overlong == "truncate" else lengths
        targets = target_counts(self.mask, self.offsets, self.lengths)
        sides = lambda a: (a[0::2], a[1::2])  # noqa: E731 (chosen, rejected) of each pair
        long_c, long_r = sides(lengths > seq_len)
        fit_c, fit_r = sides(self.lengths <= seq_len)
        has_c, has_r = sides(targets > 0)
        fits = fit_c & fit_r
        self.overlong = int(np.count_nonzero(long_c | long_r))
        self.no_targets = int(np.count_nonzero(fits & ~(has_c & has_r)))
        self.kept = np.flatnonzero(fits & has_c & has_r)
        if not len(self.kept):
            raise UserError(f"{data_dir / f'{split}.bin'}: none of its {self.pairs_total} preference pairs fits "
                            f"train.seq_len={seq_len} with a target token left on both sides; raise "
                            f"train.seq_len or set data.overlong=truncate")
        self.num_samples = len(self.kept)
        self._order = EpochOrder(seed, self.num_samples)

    def pair(self, sample: int, shuffle: bool = True) -> int:
        """Global sample index -> the pair it is (its index in the split)."""
        return int(self.kept[self._order(sample, shuffle)])

    def samples(self, indices, shuffle: bool = True) -> PairBatch:
        return self.samples_of(np.array([self.pair(s, shuffle) for s in indices], dtype=np.int64))

    def samples_of(self, pairs: np.ndarray) -> PairBatch:
        """The micro-batch of these pairs (indices in the split)."""
        examples = np.concatenate([2 * pairs, 2 * pairs + 1])  # the chosen rows, then the rejected ones
        width = int(self.lengths[examples].max())
        inputs = np.full((len(examples), width), self.pad_id, dtype=np.int64)
        targets = np.full((len(examples), width), IGNORE, dtype=np.int64)
        for row, e in enumerate(examples):
            fill_example(self, int(e), inputs[row], targets[row], 0)
        return PairBatch(inputs, targets, None, pairs)

    def batch(self, first_sample: int, size: int, shuffle: bool = True) -> PairBatch:
        return self.samples(range(first_sample, first_sample + size), shuffle)

    def summary(self) -> str:
        line = f"{self.pairs_total:,} preference pairs, {self.num_samples:,} trained on"
        if self.overlong:
            line += (f"; {self.overlong:,} with a side longer than train.seq_len={self.seq_len} "
                     f"{'truncated' if self.policy == 'truncate' else 'dropped'} (data.overlong)")
        if self.no_targets:
            line += f"; {self.no_targets:,} with a side left without a target token within train.seq_len dropped"
        return line
