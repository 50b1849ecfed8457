"""The training loader: token shards packed into fixed-length samples, shuffled from a seed, each
data-parallel rank reading only its own rows, its position kept in the checkpoint by samples.

What: the shards' token stream (documents already joined by their EOS, `mplan.data.shards`) is
cut into `num_sequences = (num_tokens - 1) // seq_len` windows of `seq_len + 1` tokens,

    window i = stream[i * seq_len : i * seq_len + seq_len + 1]
    inputs   = window[:-1]          labels = window[1:]

(neighbouring windows share one token, so every token of the stream but the last is predicted
once per epoch). Sample `s` of the run is window `perm_e[s % num_sequences]` of epoch
`e = s // num_sequences`, where `perm_e` is a permutation drawn from `(seed, e)`: one pass over all
windows per epoch, a new order each epoch. Optimizer step `t` at global batch `B` takes samples
[t*B, (t+1)*B); data-parallel rank `r` of `d` takes rows [r*B/d, (r+1)*B/d) of them.

    global_batch(step)                   the step's whole batch (pure: a function of step)
    local_batch(step, dp_rank, dp_size)  one rank's rows of it, only those read from the memmap
    next_batch(dp_rank=0, dp_size=1)     the rank's rows of the next step, then advances
                                         `consumed_samples` by the global batch

The position is `consumed_samples`, the first sample of the next step to run: `next_batch` is what
a training loop calls (every rank, each with its own loader, alike), and `state_dict()` after step
k holds k*B. Kept by samples, not steps, so a run resumed at another DP size or another global
batch continues at the very next sample: nothing repeated or skipped. `global_batch(step)` and
`local_batch` count from sample 0 at the current global batch; after a resume with another
global batch, `next_batch` is the one that continues.

`state_dict()` is JSON ({"consumed_samples", "seed", "seq_len", "global_batch",
"data_fingerprint"}), so the loader is an `extras` object of `pm.save(dir, extras={"data":
loader})` / `pm.load`. `load_state_dict` refuses, in one line, a state from another dataset
(fingerprint), another seq_len (other windows) or another seed (another order): each would
silently repeat or skip samples.

Packing for dynamic context parallelism (`packing="cp_aligned"`, `shares` = the plan's cp): the
windows are `mplan.data.cp_packing.pack_for_shares` of the stream's documents instead of fixed
cuts, so most windows' documents deal whole onto the cp ranks with balanced work and the runtime
runs them at cp=1 with no K/V exchange. A window's padding is EOS ids (each its own document under
`packed_document_ids`) with label -100; every real token's label is still the token after it in
the stream. Sample `s` is still window `perm_e[s % num_sequences]`, `num_sequences` now the pack's
windows, so `consumed_samples` keeps its meaning; the state also holds "packing" and "shares",
and a resume under another packing or another share count (other windows) is refused in one line.
The pack is the one kept beside the shards (`cp_packing.kept_packing`), else made at open from
every document's length (`document_lengths`: one scan of the stream) and kept; every token is in
exactly one window of an epoch.

Megatron's GPTDataset is the model (samples of seq_len + 1 tokens from a shuffled index, the
position as consumed samples in the checkpoint). What differs: windows are fixed cuts of the
stream and only their order is shuffled, where Megatron also shuffles documents before packing
each epoch (so its windows differ per epoch); there is no index cache on disk, since a permutation
of the windows costs a fraction of a second per million; the leftover `(num_tokens - 1) % seq_len`
tokens at the end of the stream are never read. The permutation comes from NumPy's legacy
`RandomState`, whose stream NumPy keeps fixed across versions, so a resumed run reads the same
order after an upgrade (the new `Generator` makes no such promise).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mplan.data.cp_packing import Packing, kept_packing
from mplan.data.document_lengths import document_lengths
from mplan.data.errors import DataError
from mplan.data.shards import TokenShards
from mplan.json_fields import FieldReader

MAX_SEED = (1 << 32) - 1
"""`RandomState` seeds are 32-bit words; the epoch is a second word."""

PACKINGS = ("stream", "cp_aligned")
"""stream: fixed cuts of the token stream; cp_aligned: windows packed for the cp ranks (module docstring)."""
IGNORED = -100
"""The label of a padding token (cross entropy's ignore index)."""


class PackedLoader:
    """Packed, shuffled samples of a token-shard directory (module docstring)."""

    def __init__(self, shards: TokenShards | str, *, seq_len: int, global_batch: int, seed: int = 0,
                 packing: str = "stream", shares: int = 1) -> None:
        self.shards = shards if isinstance(shards, TokenShards) else TokenShards.open(shards)
        self.seq_len = _whole(seq_len, "seq_len", 1)
        self.global_batch_size = _whole(global_batch, "global_batch", 1)
        self.seed = _whole(seed, "seed", 0)
        if self.seed > MAX_SEED:
            raise DataError(f"seed must be below 2**32 (NumPy's RandomState), got {seed}")
        if packing not in PACKINGS:
            raise DataError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
        self.packing, self.shares = packing, _whole(shares, "shares", 1)
        if packing == "cp_aligned" and self.seq_len % self.shares:
            raise DataError(f"cp_aligned packing: seq_len {self.seq_len} does not split into {self.shares} shares")
        self.pack: Packing | None = None
        """The cp-aligned windows (None: fixed cuts of the stream)."""
        if packing == "cp_aligned":
            self.pack = kept_packing(self.shards.directory, self.shards.fingerprint,
                                     lambda: document_lengths(self.shards.directory), self.seq_len, self.shares)
            self.num_sequences = len(self.pack.windows)
        else:
            self.num_sequences = (self.shards.num_tokens - 1) // self.seq_len
        """Windows in one epoch (of seq_len + 1 stream tokens, or the pack's)."""
        if self.num_sequences < 1:
            raise DataError(f"{self.shards.directory}: holds {self.shards.num_tokens} tokens, too few for one "
                            f"sample of seq_len + 1 = {self.seq_len + 1}")
        self.consumed_samples = 0
        """The first sample of the next step `next_batch` serves (the checkpointed position)."""
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def data_fingerprint(self) -> str:
        return self.shards.fingerprint

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the windows in `epoch` (int64 [num_sequences]), drawn from (seed, epoch)."""
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:  # a batch spans at most two epochs at a time
                self._permutations.pop(min(self._permutations))
            rng = np.random.RandomState([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.num_sequences).astype(np.int64)
        return self._permutations[epoch]

    def sequence_index(self, sample: int) -> int:
        """The window sample `sample` of the run reads."""
        epoch, within = divmod(sample, self.num_sequences)
        return int(self.permutation(epoch)[within])

    def samples(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [first, first + count) as (inputs, labels), int64 [count, seq_len] each."""
        if first < 0 or count < 0:
            raise ValueError(f"samples [{first}, {first + count}) must not be negative")
        if self.pack is not None:
            return self._packed_samples(first, count)
        windows = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for row in range(count):
            start = self.sequence_index(first + row) * self.seq_len
            windows[row] = self.shards.read(start, start + self.seq_len + 1)
        return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())

    def _packed_samples(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`samples` of the cp-aligned pack: each segment's tokens and their stream successors,
        padding (EOS, label IGNORED) elsewhere."""
        inputs = np.full((count, self.seq_len), self.shards.eos_id, dtype=np.int64)
        labels = np.full((count, self.seq_len), IGNORED, dtype=np.int64)
        for row in range(count):
            for offset, start, n in self.pack.windows[self.sequence_index(first + row)].segments:
                tokens = self.shards.read(start, min(start + n + 1, self.shards.num_tokens))
                inputs[row, offset:offset + n] = tokens[:n]
                labels[row, offset:offset + len(tokens) - 1] = tokens[1:]  # the stream's last token: no label
        return torch.from_numpy(inputs), torch.from_numpy(labels)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Optimizer step `step`'s whole batch: samples [step*B, (step+1)*B)."""
        return self.samples(step * self.global_batch_size, self.global_batch_size)

    def local_batch(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `dp_rank`'s rows of `global_batch(step)`: [dp_rank*B/dp_size, (dp_rank+1)*B/dp_size)."""
        rows = self._rows_per_rank(dp_rank, dp_size)
        return self.samples(step * self.global_batch_size + dp_rank * rows, rows)

    def next_batch(self, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `dp_rank`'s rows of the next step's batch (samples from `consumed_samples`); then
        `consumed_samples` moves on by the whole global batch (every rank's loader alike)."""
        rows = self._rows_per_rank(dp_rank, dp_size)
        batch = self.samples(self.consumed_samples + dp_rank * rows, rows)
        self.consumed_samples += self.global_batch_size
        return batch

    def _rows_per_rank(self, dp_rank: int, dp_size: int) -> int:
        if not (isinstance(dp_size, int) and dp_size >= 1 and self.global_batch_size % dp_size == 0):
            raise ValueError(f"global_batch {self.global_batch_size} must split evenly over dp_size {dp_size}")
        if not (isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        return self.global_batch_size // dp_size

    def state_dict(self) -> dict[str, Any]:
        """The position (the next step's first sample) and what it means, as JSON values."""
        state = {"consumed_samples": self.consumed_samples, "seed": self.seed, "seq_len": self.seq_len,
                 "global_batch": self.global_batch_size, "data_fingerprint": self.data_fingerprint}
        if self.pack is not None:  # a stream loader's state is as it was before packings existed
            state.update(packing=self.packing, shares=self.shares)
        return state

    def load_state_dict(self, state: Any) -> None:
        """Resume at `state`'s sample. Refused (one line) when saved on other data, another seq_len
        or another seed; another global batch or DP size continues at the same sample."""
        r = FieldReader(state, file="data loader state", path="", error=DataError)
        consumed = r.integer("consumed_samples", minimum=0)
        seq_len, seed = r.integer("seq_len"), r.integer("seed", minimum=0)
        r.integer("global_batch")
        fingerprint = r.string("data_fingerprint")
        packing = r.string("packing", choices=PACKINGS) if r.has("packing") else "stream"
        shares = r.integer("shares") if r.has("shares") else 1
        r.finish()
        if fingerprint != self.data_fingerprint:
            raise DataError(f"data loader state: saved on dataset {fingerprint[:12]}, but {self.shards.directory} "
                            f"is {self.data_fingerprint[:12]}: resuming on other data would repeat or skip samples")
        for name, saved, mine in (("seq_len", seq_len, self.seq_len), ("seed", seed, self.seed)):
            if saved != mine:
                raise DataError(f"data loader state: saved with {name} {saved}, this loader has {mine}: the samples "
                                f"would be another {'cut' if name == 'seq_len' else 'order'} of the data, "
                                f"repeating or skipping some")
        if (packing, shares if packing == "cp_aligned" else 1) != (self.packing, self.shares if self.pack else 1):
            raise DataError(f"data loader state: saved with packing {packing}" + (f" for {shares} shares" if packing
                            == "cp_aligned" else "") + f", this loader packs {self.packing}" + (
                            f" for {self.shares} shares" if self.pack else "") + ": other windows, repeating or "
                            f"skipping samples")
        self.consumed_samples = consumed


def packed_document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Int64 [rows, S]: each token's document within its window, numbered from 0 along the row.
    The stream joins documents by their EOS (`mplan.data.shards`), so a document ends at its EOS
    and the next starts after it: a token's id is the number of EOS tokens before it in the row."""
    ends = (inputs == eos_id).to(torch.int64)
    return ends.cumsum(dim=1) - ends


def _whole(value: Any, name: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
