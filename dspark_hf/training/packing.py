"""Anchor-bounded packing (paper §3.3 / §5.1) of training batches from cached rows held as flat tensors.

A :class:`FeatureStore` holds one split's rows on the training device: the token ids and the target's top-K
distributions as flat tensors, the context features as one view per row (on a CPU, views of the memory-mapped
shard files, read when packed; on an accelerator, of one tensor in its memory). A :class:`FeatureBatcher` draws rows
and anchors on the CPU and builds each batch there with a handful of gathers, so on a GPU the batch never crosses
the bus and packing costs no per-anchor Python.

Shape symbols: ``R`` rows, ``S`` sequences in a batch, ``A`` anchors per sequence, ``γ`` block size, ``n`` context
positions, ``W = m * d`` feature width, ``K`` the target's stored top-k.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import datasets
import pyarrow as pa
import torch
from torch.nn.utils.rnn import pad_sequence

from .data import shard_dirs


def mapped_rows(data_dir: str | Path, split: str) -> Iterator[dict]:
    """The rows of ``split`` under ``data_dir`` (shards in order) as dicts of tensors that VIEW the shard files.

    Keys: ``input_ids`` ``[n]`` int32, ``prompt_len`` int, ``features`` ``[n - 1, W]`` fp16, ``topk_ids``
    ``[n - prompt_len - 1, K]`` int32, ``topk_probs`` ``[n - prompt_len - 1, K]`` fp16. Nothing is copied: the
    tensors are zero-copy views of the memory-mapped Arrow files (read-only; the OS reads pages when they are used).

    Raises:
        FileNotFoundError: no shards under ``data_dir`` (as :func:`~dspark_hf.training.data.load_shards`).
    """
    for shard in shard_dirs(data_dir):
        for batch in datasets.load_from_disk(str(shard)).data.table.to_batches():
            splits = batch.column("split").to_pylist()
            if split not in splits:
                continue
            prompt_lens = batch.column("prompt_len").to_pylist()
            columns = {name: _list_rows(batch.column(name)) for name in ("input_ids", "features", "topk_ids", "topk_probs")}
            for i, (row_split, p) in enumerate(zip(splits, prompt_lens)):
                if row_split == split:
                    yield {"prompt_len": p} | {name: values[offsets[i] : offsets[i + 1]]
                                               for name, (values, offsets) in columns.items()}


def _list_rows(array) -> tuple[torch.Tensor, list[int]]:
    """A list column of a record batch (``Sequence`` or ``Array2D``) as ``(values, offsets)``: row ``i`` is
    ``values[offsets[i] : offsets[i + 1]]``; ``values`` is a zero-copy tensor over the Arrow buffer."""
    storage = getattr(array, "storage", array)  # Array2D is an extension type over list<list<...>>
    offsets = storage.offsets.to_numpy()
    values = storage.flatten()  # the rows' values only (a sliced array starts at offsets[0])
    rows, two_d = len(values), pa.types.is_list(values.type) or pa.types.is_fixed_size_list(values.type)  # Array2D
    flat = (values.flatten() if two_d else values).to_numpy(zero_copy_only=True)
    with warnings.catch_warnings():  # a read-only buffer: the store never writes to it
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(flat)
    return tensor.view(rows, len(flat) // max(rows, 1)) if two_d else tensor, (offsets - offsets[0]).tolist()


class FeatureStore:
    """The cached rows of one split on one device, as the packer reads them.

    Args:
        rows: dicts with ``input_ids`` ``[n]``, ``prompt_len``, ``features`` ``[n - 1, W]`` fp16, ``topk_ids`` /
            ``topk_probs`` ``[n - prompt_len - 1, K]`` (a list of row dicts, a ``datasets`` split, or
            :func:`mapped_rows`).
        device: where the batches are built.
        resident: copy the features into one tensor on ``device`` (fp16, ``Σ (n - 1) × W × 2`` bytes); default: on
            an accelerator. Otherwise they stay where they are (a CPU store's memory-mapped views).

    Attributes:
        features: one ``[n_r - 1, W]`` fp16 tensor per row.
        input_ids: ``[Σ n_r]`` int64, row ``r`` from ``id_start[r]``; ``topk_ids`` ``[Σ (n_r - p_r - 1), K]`` int32
            and ``topk_probs`` (fp16) likewise from ``topk_start[r]``; ``lengths`` / ``prompt_lens`` ``[R]`` int64.
            All on ``device``; ``lengths`` and ``prompt_lens`` also as lists (``n``, ``p``) for the CPU's sampling.

    Raises:
        ValueError: a row's features or top-K rows do not match its token count.
    """

    def __init__(self, rows: Iterable[dict], device: str | torch.device = "cpu", resident: bool | None = None):
        self.device = torch.device(device)
        self.resident = self.device.type != "cpu" if resident is None else resident
        rows = list(rows)
        self.n = [len(r["input_ids"]) for r in rows]
        self.p = [int(r["prompt_len"]) for r in rows]
        for i, (row, n, p) in enumerate(zip(rows, self.n, self.p)):
            if len(row["features"]) != n - 1 or len(row["topk_ids"]) != n - p - 1:
                raise ValueError(f"row {i}: {len(row['features'])} feature rows and {len(row['topk_ids'])} top-K rows "
                                 f"for {n} tokens after a prompt of {p}; expected n - 1 and n - prompt_len - 1.")
        as_tensor = lambda key, dtype=None: [torch.as_tensor(r[key], dtype=dtype) for r in rows]  # noqa: E731
        self.features = self._features(as_tensor("features", torch.float16))
        flat = lambda parts: torch.cat(parts).to(self.device) if parts else torch.zeros(0)  # noqa: E731
        self.input_ids = flat(as_tensor("input_ids", torch.long))
        self.topk_ids, self.topk_probs = flat(as_tensor("topk_ids", torch.int32)), flat(as_tensor("topk_probs", torch.float16))
        self.lengths = torch.tensor(self.n, dtype=torch.long, device=self.device)
        self.prompt_lens = torch.tensor(self.p, dtype=torch.long, device=self.device)
        self.id_start = _starts(self.n, self.device)
        self.topk_start = _starts([n - p - 1 for n, p in zip(self.n, self.p)], self.device)

    @classmethod
    def from_shards(cls, data_dirs: list[str | Path], split: str, device: str | torch.device = "cpu",
                    resident: bool | None = None) -> "FeatureStore":
        """The rows of ``split`` in every folder of ``data_dirs`` (in that order), through :func:`mapped_rows`."""
        return cls(itertools.chain.from_iterable(mapped_rows(d, split) for d in data_dirs), device, resident)

    def __len__(self) -> int:
        return len(self.n)

    def _features(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.resident or not parts:
            return [part.to(self.device) for part in parts]
        flat = torch.empty(sum(map(len, parts)), parts[0].shape[-1], dtype=torch.float16, device=self.device)
        for part, view in zip(parts, views := list(flat.split([len(p) for p in parts]))):
            view.copy_(part)  # one row at a time: the host never holds a second copy
        return views

    def response_tokens(self) -> torch.Tensor:
        """Every row's response token ids, concatenated (``[Σ (n_r - p_r)]`` int64)."""
        row = torch.repeat_interleave(torch.arange(len(self), device=self.device), self.lengths)
        offset = torch.arange(len(self.input_ids), device=self.device) - self.id_start[row]
        return self.input_ids[offset >= self.prompt_lens[row]]


def _starts(counts: list[int], device: torch.device) -> torch.Tensor:
    """``[len(counts)]`` exclusive cumulative sums: where each row's slice of a flat tensor starts."""
    counts = torch.tensor(counts, dtype=torch.long)
    return (counts.cumsum(0) - counts).to(device)


class FeatureBatcher:
    """Samples packed training batches from a :class:`FeatureStore` (anchor-bounded packing, §3.3 / §5.1).

    ``labels``: the cross-entropy label of draft position ``k``, the row's next token (``"data"``: the target's own
    sample for regenerated rows) or the target's top-1 there (``"target"``: for dataset replies, whose next token
    the target did not choose). Rows and anchors are drawn on the CPU from ``generator``; batches are built on the
    store's device.
    """

    def __init__(self, store: FeatureStore, drafter, block_size: int, generator: torch.Generator, labels: str = "data"):
        self.store = store
        self.index = [r for r, (n, p) in enumerate(zip(store.n, store.p)) if n - p >= 2]
        if not self.index:
            raise ValueError(f"No usable rows among {len(store.n)} (every response is shorter than 2 tokens).")
        self.vocab_index = drafter.vocab_index.to(store.device)
        self.oov = drafter.draft_vocab.numel()
        self.gamma = block_size
        self.generator = generator
        self.labels = labels

    def usable(self, limit: int | None = None) -> list[int]:
        """The store's first ``limit`` rows with at least one anchor (row numbers)."""
        return self.index[:limit]

    def sample(self, sequences: int, anchors: int, rank: int = 0, world: int = 1) -> dict:
        """A global batch of ``sequences`` random rows with up to ``anchors`` anchors each, of which this
        process packs its share, the rows ``rank::world``.

        Every process draws the whole batch (rows and anchors) from the same generator, so the processes'
        generators stay in step and their shares together are exactly the batch one process would pack.
        """
        picks = torch.randint(len(self.index), (sequences,), generator=self.generator).tolist()
        rows = [self.index[i] for i in picks]
        per_row = [self._anchors(r, anchors) for r in rows]
        return self._pack(rows[rank::world], per_row[rank::world])

    def pack(self, rows: list[int], anchors: int) -> dict:
        """Pack the store's ``rows`` with up to ``anchors`` anchors each (see ``DSparkDrafter.forward``)."""
        return self._pack(rows, [self._anchors(r, anchors) for r in rows])

    def _pack(self, rows: list[int], per_row: list[torch.Tensor]) -> dict:
        """Dense tensors on the store's device: ``features`` ``[S, n, W]`` (n = the last anchor), ``anchors``
        ``[S, A]``, ``tokens`` ``[S, A, γ + 1]`` (the anchor's token, then the block's), ``valid`` ``[S, A, γ]``,
        ``labels`` ``[S, A, γ]`` and ``target_ids`` ``[S, A, γ, K]`` (draft-vocabulary rows, -1 outside it),
        ``target_probs`` ``[S, A, γ, K]``; zeros (and ``valid`` False) past a row's end and in missing anchors."""
        store, g, dev = self.store, self.gamma, self.store.device
        n = max(int(a.max()) for a in per_row)
        anchors = pad_sequence(per_row, batch_first=True).to(dev)  # [S, A]
        present = pad_sequence([torch.ones(len(a), dtype=torch.bool) for a in per_row], batch_first=True).to(dev)
        r = torch.tensor(rows, device=dev)
        span = (store.lengths[r, None] - 1 - anchors).clamp(max=g)  # [S, A] draft positions with a ground-truth token
        steps = torch.arange(g + 1, device=dev)
        has_token = (steps <= span[..., None]) & present[..., None]  # [S, A, γ + 1]
        at = (store.id_start[r, None, None] + anchors[..., None] + steps).clamp(max=len(store.input_ids) - 1)
        tokens = torch.where(has_token, store.input_ids[at], 0)
        valid = has_token[..., 1:]  # draft position k has the ground truth token k + 1
        at = store.topk_start[r, None, None] + (anchors - store.prompt_lens[r, None])[..., None] + steps[:g]
        at = at.clamp(0, len(store.topk_ids) - 1)  # [S, A, γ]: the target's distribution after token k
        top_ids = torch.where(valid[..., None], store.topk_ids[at].long(), 0)
        top_probs = torch.where(valid[..., None], store.topk_probs[at].float(), 0.0)
        feats = torch.zeros(len(rows), n, store.features[rows[0]].shape[-1], dtype=torch.float16, device=dev)
        for s, row in enumerate(rows):  # one contiguous copy per sequence: context positions < n
            part = store.features[row][:n]
            feats[s, : len(part)] = part
        rows_of = lambda t: torch.where(self.vocab_index[t] < self.oov, self.vocab_index[t], -1)  # noqa: E731
        target_ids = rows_of(top_ids)
        labels = rows_of(tokens[..., 1:]) if self.labels == "data" else target_ids[..., 0]
        return dict(features=feats, anchors=anchors, tokens=tokens, valid=valid, labels=labels,
                    target_ids=target_ids, target_probs=top_probs)

    def _anchors(self, row: int, count: int) -> torch.Tensor:
        """Sorted anchor positions in ``[prompt_len, n - 2]`` (each has >= 1 token to predict)."""
        lo, hi = self.store.p[row], self.store.n[row] - 2
        choices = torch.randperm(hi - lo + 1, generator=self.generator)[:count] + lo
        return choices.sort().values
