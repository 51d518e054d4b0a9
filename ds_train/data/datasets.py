"""Reading prepared data: packed windows for pretraining (TokenData, with weighted mixtures) and
sequences of instruction examples (SftData) and preference pairs (PreferenceData, data/pairs.py),
each in a seeded order, sharded by data-parallel rank.

Sample order is a pure function of (seed, global sample index): global sample g lives in epoch
g // n at position perm_epoch[g % n], so the data position is just `samples_consumed` and a resume
(at any world size) continues the exact same stream. Each data-parallel rank reads a disjoint
slice of every global batch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_train.config import DataConfig
from ds_train.data.examples import IGNORE, Batch, EpochOrder, fill_example, target_counts
from ds_train.data.pairs import PreferenceData
from ds_train.errors import UserError


class TokenData:
    """Packed fixed-length windows over a .bin memmap, sharded by rank, in a seeded order.

    With `weights` (a mixture), each source's token range (`ranges`, from meta.json) has its own
    windows and its own seeded epochs, and the global sample order draws from the sources in
    proportion to the weights: a fixed, seeded cycle of MIX_SLOTS slots in which source i holds
    round(w_i / sum(w) * MIX_SLOTS) of them. Sample g is still a pure function of (seed, g)."""

    MIX_SLOTS = 1000

    def __init__(self, path: Path, dtype: str, seq_len: int, seed: int, ranges: list | None = None,
                 weights: list | None = None, names: list | None = None):
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples <= 0:
            raise UserError(f"{path}: {len(self.tokens)} tokens is fewer than train.seq_len + 1 "
                            f"= {seq_len + 1}; use a shorter seq_len or more data")
        self._perms: dict = {}
        self.mix = None
        if weights:
            self._mixture(path, ranges, weights, names or [str(i) for i in range(len(weights))])

    def _mixture(self, path: Path, ranges: list, weights: list, names: list) -> None:
        starts = np.array([r[0] for r in ranges], dtype=np.int64)
        counts = np.array([max(0, (r[1] - r[0] - 1) // self.seq_len) for r in ranges], dtype=np.int64)
        for name, n, r in zip(names, counts, ranges):
            if n <= 0:
                raise UserError(f"data.weights: source {name!r} has {r[1] - r[0]} training tokens in {path}, fewer "
                                f"than train.seq_len + 1 = {self.seq_len + 1}; give it a weight only with more "
                                f"data, or drop it from data.sources")
        share = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * self.MIX_SLOTS
        slots = np.maximum(1, np.floor(share).astype(np.int64))
        for i in np.argsort(-(share - np.floor(share)), kind="stable")[:max(0, self.MIX_SLOTS - int(slots.sum()))]:
            slots[i] += 1  # largest remainders
        order = np.random.default_rng([self.seed, 2**31]).permutation(np.repeat(np.arange(len(slots)), slots))
        rank = np.zeros(len(order), dtype=np.int64)
        seen = np.zeros(len(slots), dtype=np.int64)
        for j, src in enumerate(order):
            rank[j], seen[src] = seen[src], seen[src] + 1
        self.mix = (starts, counts, slots, order, rank)
        self.num_samples = int(counts.sum())  # an "epoch" of the mixture, for reporting

    def _order(self, key: int, epoch: int, n: int) -> np.ndarray:
        cached = self._perms.get(key)
        if cached is None or cached[0] != epoch:
            seed = [self.seed, epoch] if key < 0 else [self.seed, epoch, key]
            cached = self._perms[key] = (epoch, np.random.default_rng(seed).permutation(n))
        return cached[1]

    def start(self, sample: int, shuffle: bool = True) -> int:
        """Global sample index -> the token offset its window starts at."""
        if self.mix is None or not shuffle:
            epoch, i = divmod(sample, self.num_samples)
            idx = self._order(-1, epoch, self.num_samples)[i] if shuffle else i
            return int(idx) * self.seq_len
        starts, counts, slots, order, rank = self.mix
        cycle, slot = divmod(sample, self.MIX_SLOTS)
        src = int(order[slot])
        epoch, i = divmod(cycle * int(slots[src]) + int(rank[slot]), int(counts[src]))
        return int(starts[src]) + int(self._order(src, epoch, int(counts[src]))[i]) * self.seq_len

    def window(self, sample: int, shuffle: bool = True) -> np.ndarray:
        """Global sample index -> seq_len + 1 tokens (inputs and shifted targets)."""
        start = self.start(sample, shuffle)
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def samples(self, indices, shuffle: bool = True) -> np.ndarray:
        return np.stack([self.window(s, shuffle) for s in indices])

    def batch(self, first_sample: int, size: int, shuffle: bool = True) -> np.ndarray:
        return self.samples(range(first_sample, first_sample + size), shuffle)


class SftData:
    """Instruction examples (data.format sft) as sequences of seq_len tokens: several whole examples
    per sequence (`pack`: best fit in a seeded order of the examples, fixed for the run), else one
    each, padded. Sequences are drawn in a seeded order per epoch like TokenData's windows, so the
    data position is the number of samples consumed. An example longer than seq_len is dropped or
    truncated (`overlong`); one left without a target token is dropped."""

    def __init__(self, data_dir: Path, split: str, dtype: str, seq_len: int, seed: int, pack: bool,
                 overlong: str, pad_id: int, shuffle_pack: bool = True):
        self.tokens = np.memmap(data_dir / f"{split}.bin", dtype=np.dtype(dtype), mode="r")
        self.mask = np.memmap(data_dir / f"{split}.mask", dtype=np.uint8, mode="r")
        self.offsets = np.fromfile(data_dir / f"{split}.idx", dtype=np.int64)
        self.seq_len, self.seed, self.pack, self.pad_id, self.policy = seq_len, seed, pack, pad_id, overlong
        lengths = np.diff(self.offsets)
        self.examples = len(lengths)
        self.overlong = int(np.count_nonzero(lengths > seq_len))
        self.lengths = np.minimum(lengths, seq_len) if overlong == "truncate" else lengths
        keep = self.lengths <= seq_len
        targets = target_counts(self.mask, self.offsets, self.lengths)
        self.no_targets = int(np.count_nonzero(keep & (targets == 0)))
        kept = np.flatnonzero(keep & (targets > 0))
        if not len(kept):
            raise UserError(f"{data_dir / f'{split}.bin'}: none of its {self.examples} examples fits train.seq_len="
                            f"{seq_len} with a target token left; raise train.seq_len or set "
                            f"data.overlong=truncate")
        if shuffle_pack:
            kept = kept[np.random.default_rng([seed, 2**32]).permutation(len(kept))]
        self.order, self.bins = self._pack(kept) if pack else (kept, np.arange(len(kept) + 1))
        self.num_samples = len(self.bins) - 1
        self.fill = float(self.lengths[kept].sum()) / (self.num_samples * seq_len)
        self._order = EpochOrder(seed, self.num_samples)

    def _pack(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Best fit, in `order`: each example goes into the open sequence with the least room that
        still holds it. Returns the examples grouped by sequence, and each sequence's bounds."""
        room_of: dict[int, list[int]] = {}  # free tokens -> sequences with that much room
        rooms: list[int] = []  # the distinct free-token counts, sorted
        seq_of = np.empty(len(order), dtype=np.int64)
        count = 0
        for j, n in enumerate(self.lengths[order].tolist()):
            k = bisect.bisect_left(rooms, n)
            if k < len(rooms):
                room = rooms[k]
                seq = room_of[room].pop()
                if not room_of[room]:
                    del room_of[room], rooms[k]
            else:
                room, seq, count = self.seq_len, count, count + 1
            seq_of[j] = seq
            left = room - n
            if left not in room_of:
                room_of[left] = []
                bisect.insort(rooms, left)
            room_of[left].append(seq)
        grouped = np.argsort(seq_of, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(seq_of, minlength=count))])
        return order[grouped], bounds

    def window(self, sample: int, shuffle: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        i = self._order(sample, shuffle)
        L = self.seq_len
        inputs = np.full(L, self.pad_id, dtype=np.int64)
        targets = np.full(L, IGNORE, dtype=np.int64)
        positions = np.zeros(L, dtype=np.int64)
        at = 0
        for e in self.order[self.bins[i]:self.bins[i + 1]]:
            n = fill_example(self, int(e), inputs, targets, at)
            positions[at:at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(L - at)  # padding: one more "example", with no targets
        return inputs, targets, positions

    def samples(self, indices, shuffle: bool = True) -> Batch:
        inputs, targets, positions = (np.stack(col) for col in zip(*(self.window(s, shuffle) for s in indices)))
        return Batch(inputs, targets, positions if self.pack else None)

    def batch(self, first_sample: int, size: int, shuffle: bool = True) -> Batch:
        return self.samples(range(first_sample, first_sample + size), shuffle)

    def summary(self) -> str:
        how = "packed into" if self.pack else "padded to"
        line = (f"{self.examples:,} examples {how} {self.num_samples:,} sequences of {self.seq_len} "
                f"({self.fill:.0%} non-pad tokens)")
        if self.overlong:
            line += (f"; {self.overlong:,} longer than train.seq_len="
                     f"{self.seq_len} {'truncated' if self.policy == 'truncate' else 'dropped'} (data.overlong)")
        if self.no_targets:
            line += f"; {self.no_targets:,} without a target token within train.seq_len dropped"
        return line


def sequence_shard(batch: np.ndarray | Batch, rank: int, size: int) -> np.ndarray | Batch:
    """Sequence rank `rank`'s part of a micro-batch under Ulysses sequence parallelism (`size`
    ranks): seq_len / size consecutive positions of every sequence, as inputs, targets shifted
    before the split (so the last target of a part is the next part's first input) and the
    sequence's own position ids (the attention gathers them back). size 1: the batch as it is."""
    if size == 1:
        return batch
    if not isinstance(batch, Batch):  # a window of seq_len + 1 tokens
        batch = Batch(batch[:, :-1], batch[:, 1:], None)
    rows, length = batch.inputs.shape
    positions = batch.positions if batch.positions is not None else np.broadcast_to(np.arange(length), (rows, length))
    part = slice(rank * length // size, (rank + 1) * length // size)  # seq_len % size == 0 is checked at start
    return Batch(*(np.ascontiguousarray(a[:, part]) for a in (batch.inputs, batch.targets, positions)))


def rank_micro_batches(data: TokenData | SftData | PreferenceData, step: int, global_batch: int, micro: int,
                       data_rank: int, data_parallel: int) -> list:
    """The micro-batches data-parallel rank `data_rank` trains on at `step` (0-based): a disjoint
    slice of the global batch (the sequence / tensor ranks of one data-parallel group read the same)."""
    per_rank = global_batch // data_parallel
    first = step * global_batch + data_rank * per_rank
    return [data.batch(first + k * micro, micro) for k in range(per_rank // micro)]


def eval_micro_batches(data: TokenData | SftData | PreferenceData, batches: int, micro: int, data_rank: int,
                       data_parallel: int) -> list:
    """A fixed evaluation set: the first batches x micro x data-parallel sequences of the val split,
    in file order."""
    out = []
    for b in range(batches):
        first = (b * data_parallel + data_rank) * micro
        out.append(data.samples([s % data.num_samples for s in range(first, first + micro)], shuffle=False))
    return out


@dataclass(frozen=True)
class Datasets:
    train: TokenData | SftData | PreferenceData
    val: TokenData | SftData | PreferenceData
    summary: str = ""  # how sft examples became sequences (said at the start of a run)

    @property
    def packed(self) -> bool:
        """Several examples to a sequence, position ids restarting at each (sft with packing)."""
        return isinstance(self.train, SftData) and self.train.pack

    def identity(self) -> dict:
        """What identifies the sample stream, recorded in every checkpoint (a resume checks it)."""
        out = {"train_tokens": len(self.train.tokens), "val_tokens": len(self.val.tokens)}
        if isinstance(self.train, PreferenceData):
            out |= {"format": "preference", "train_samples": self.train.num_samples}
        elif isinstance(self.train, SftData):
            out |= {"format": "sft", "train_samples": self.train.num_samples, "packed": self.train.pack}
        elif self.train.mix is not None:
            out["mixture_slots"] = self.train.mix[2].tolist()
        return out


def build_datasets(d: DataConfig, meta: dict, seq_len: int, seed: int, can_pack: bool,
                   model_name: str = "the model") -> Datasets:
    """The train and val datasets of a prepared data.dir (`meta`: its meta.json, loaded): windows of
    seq_len + 1 tokens (text, a weighted mixture with data.weights), or instruction sequences (sft),
    packed where the model's attention keeps packed examples apart (`can_pack`)."""
    if meta.get("format", "text") != d.format:
        raise UserError(f"data.dir {d.dir!r} holds {meta.get('format', 'text')} data and data.format is "
                        f"{d.format}; prepare it again (data.reprepare=true) or set data.format")
    if d.format == "preference":
        pad = meta.get("eos_token_id") or 0
        train, val = (PreferenceData(Path(d.dir), split, meta["dtype"], seq_len, seed, d.overlong, pad)
                      for split in ("train", "val"))
        return Datasets(train, val, f"preference, {train.summary()}" + (
            f"; {meta['identical_pairs']:,} pairs whose chosen and rejected are the same were left out by "
            f"prepare" if meta.get("identical_pairs") else ""))
    if d.format == "sft":
        if d.pack is True and not can_pack:
            raise UserError(f"data.pack: {model_name} does not separate packed examples (its attention mask "
                            f"ignores position_ids); set data.pack=auto or false")
        pack = can_pack if d.pack == "auto" else bool(d.pack)
        pad = meta.get("eos_token_id") or 0
        train, val = (SftData(Path(d.dir), split, meta["dtype"], seq_len, seed, pack, d.overlong, pad,
                              shuffle_pack=split == "train") for split in ("train", "val"))
        why = "" if pack or d.pack is False else " (the model's attention cannot keep packed examples apart)"
        return Datasets(train, val, f"sft, {train.summary()}{why}")
    ranges = meta.get("source_ranges") if d.weights else None
    if d.weights and (not isinstance(ranges, list) or len(ranges) != len(d.weights)):
        raise UserError(f"data.weights: data.dir {d.dir!r} does not record where each of the "
                        f"{len(d.weights)} sources lies (prepared by an older ds_train, or from other "
                        f"sources); prepare it again with data.reprepare=true")
    return Datasets(*(TokenData(Path(d.dir) / f"{split}.bin", meta["dtype"], seq_len, seed,
                                ranges if split == "train" else None, d.weights if split == "train" else None,
                                d.sources) for split in ("train", "val")))
