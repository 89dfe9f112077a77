"""The batches a peer trains on, window after window, from the run's dataset.

    feed = DataFeed(spec, key=peer_id, opener=lambda: dataset_of(spec, store, settings.data))
    batches = feed.batches(window)    # the dataset is opened on first use; window + 1 is prefetched
    feed.take_usage()                 # DataUsage since the last call: bytes fetched, hits, misses

The dataset is opened (its signed manifest fetched and verified) on the first window, not when the
peer starts: a peer waits for its run's genesis first, and a run that does not exist yet has no
manifest either. While the peer trains window t, the pages of window t + 1 are fetched in the
background, so that training rarely waits on the network. Opening and reading raise
:class:`~protocol.errors.StoreError` (:class:`~protocol.errors.DataUnavailable` for a block that
cannot be had intact) or :class:`~protocol.errors.ProtocolError`; the trainer skips the window with
that reason (:func:`skip_reason`), and the next window tries again.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from protocol.config import RunSpec
from protocol.data.assignment import assigned_batches, assigned_spans, open_dataset
from protocol.data.tokens import DataUsage, TokenDataset
from protocol.errors import ConfigError, ProtocolError, StoreError

__all__ = ["DataFeed", "skip_reason"]


def skip_reason(exc: ProtocolError | StoreError) -> str:
    """Why a window without its data is skipped: ``no data: data_unavailable: shard …: digest_mismatch: …``."""
    text = str(exc)
    return "no data: " + (text if text.startswith(f"{exc.reason}: ") else f"{exc.reason}: {text}")


class DataFeed:
    """Peer (or pipeline replica) ``key``'s batches of run ``spec``, from ``opener``'s dataset.

    Without ``opener``: the local built-in corpus, for an in-process run whose RunSpec names no
    dataset (tests); a RunSpec that names one must say where it comes from."""

    def __init__(self, spec: RunSpec, *, key: str, opener: Callable[[], TokenDataset] | None = None) -> None:
        if opener is None and spec.data.dataset:
            raise ConfigError("this run's dataset lies in its store: give the trainer a dataset opener")
        self.spec, self.key = spec, key
        self._opener = opener or self._local
        self._dataset: TokenDataset | None = None
        self._reported = DataUsage()

    def _local(self) -> TokenDataset:
        return open_dataset(self.spec.data)

    def dataset(self) -> TokenDataset:
        """The dataset, opened on first use (a failure is raised, and the next call tries again)."""
        if self._dataset is None:
            self._dataset = self._opener()
        return self._dataset

    def batches(self, window: int) -> list[Tensor]:
        """This key's batches of ``window``, then the next window's pages prefetched."""
        ds, s, d = self.dataset(), self.spec, self.spec.data
        out = assigned_batches(ds, s.seed, self.key, window, s.inner.steps, d.batch_size, d.seq_len, pages=d.pages)
        later = assigned_spans(ds, s.seed, self.key, window + 1, s.inner.steps, d.batch_size, d.seq_len, pages=d.pages)
        ds.prefetch("train", later)
        return out

    def take_usage(self) -> DataUsage:
        """What reaching the data cost since the last call."""
        if self._dataset is None:
            return DataUsage()
        now = self._dataset.usage()
        delta, self._reported = now - self._reported, now
        return delta
