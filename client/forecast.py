"""The aggregate in flight, forecast from the contributions already in the store (``outer.eager``).

A peer that trains window t while aggregate t−1 is still being scored and published (the
overlapped schedule, :mod:`client.peer`) starts from θ_t−1, which lacks that aggregate. With
``outer.eager`` it starts from θ_t−1 − α·Δ̄′ instead, where Δ̄′ is the aggregate the validator
would publish if it accepted exactly the contributions of window t−1 this peer can see: its own
and those in ``contrib/<t−1>/`` of the peers whose contributions made the last aggregate, checked
as the validator checks them up to the point a peer can (signature, run, window, codec, schema,
finite values, a base the window accepts) and aggregated by the same function
(:func:`protocol.aggregate.aggregate`, peer-id order) into its published form
(:func:`protocol.broadcast.publishable`). That is exactly Δ̄ whenever the validator
accepts the same set — the usual case — so the working model is then exactly θ_t plus this
window's progress, as if the peer had waited. Otherwise the difference is corrected when Δ̄ arrives.

    forecast = Forecast(spec, store, window=t - 1, bases={base}, trusted=manifest_peers, own=(me, sent))
    forecast.refresh()              # fetch what was uploaded since; True when Δ̄′ changed
    forecast.delta                  # Δ̄′ (sparse, what apply_outer takes)
    forecast.complete               # every trusted peer's contribution looked at: Δ̄′ is final

Each contribution is fetched once; what a peer downloads for it is one contribution per peer of
the last aggregate and window. Objects that fail a check are left out (never an error: they are
someone else's problem, and the validator's).

A refresh costs the bucket one LIST (class A) of the window's contributions, or, once at most
:data:`EXACT_READS` trusted peers are still missing, a GET of each of their exact keys instead
(class B: a 404 while one is not there, the contribution itself once it is, which a LIST would
have been followed by anyway); a complete forecast asks nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

import torch

from protocol import layout
from protocol.aggregate import SparseDict, aggregate, sparse_of
from protocol.broadcast import applied, publishable
from protocol.caps import object_caps
from protocol.codec import Encoded
from protocol.config import RunSpec
from protocol.errors import ProtocolError, StoreError
from protocol.feedback import FeedbackState
from protocol.model import param_schema
from protocol.store.base import EXACT_READS, ObjectStore
from protocol.wire import decode_contribution

__all__ = ["EXACT_READS", "Forecast", "same_delta"]

log = logging.getLogger(__name__)


class Forecast:
    """Δ̄′ of ``window`` from the contributions in ``store`` (module docstring).

    ``bases``: the bases a contribution of ``window`` may have (the validator's accepted bases).
    ``trusted``: the peers whose contributions count (those of the last aggregate); None: every
    peer. ``own``: this peer's id and its own Δ̂ for ``window`` (not fetched), if it sent one.
    """

    def __init__(
        self,
        spec: RunSpec,
        store: ObjectStore,
        *,
        window: int,
        bases: Collection[str],
        trusted: Collection[str] | None,
        own: tuple[str, Mapping[str, Encoded]] | None,
    ) -> None:
        self.spec, self.store, self.window = spec, store, window
        self.run = layout.run_id(spec.hash())
        self.bases = frozenset(bases)
        self.trusted = None if trusted is None else frozenset(trusted)
        self.schema = param_schema(spec.model)
        self._seen: set[str] = set()  # keys looked at (fetched, or refused without fetching)
        self._parts: dict[str, SparseDict] = {}  # peer id -> its Δ̂ in sparse form
        if own is not None:
            peer, sent = own
            self._seen.add(layout.contrib_key(self.run, window, peer))
            self._parts[peer] = sparse_of(sent)
        self.delta: SparseDict = self._aggregate()

    @property
    def contributors(self) -> int:
        return len(self._parts)

    @property
    def complete(self) -> bool:
        """Whether every trusted peer's contribution has been looked at (taken or left out): the
        forecast cannot change before the aggregate is out. Never true without a trusted set."""
        if self.trusted is None:
            return False
        return all(layout.contrib_key(self.run, self.window, p) in self._seen for p in self.trusted)

    def refresh(self) -> bool:
        """Fetch the contributions uploaded since the last call; True when Δ̄′ changed. A store
        that fails leaves the forecast as it is (tried again on the next call). Complete: nothing
        is asked (module docstring for what a refresh asks)."""
        if self.complete:
            return False
        missing = self._missing()
        if missing is not None and len(missing) <= EXACT_READS:
            keys = missing  # a GET each (a 404 for one not there yet) instead of a LIST
        else:
            try:
                prefix = layout.contrib_prefix(self.run, self.window)
                # a DHT store decodes only the listing entries of the trusted peers
                keys = (
                    self.store.list(prefix)
                    if self.trusted is None
                    else self.store.list_written_by(prefix, self.trusted)
                )
            except StoreError as exc:
                log.info("forecast of aggregate %d: listing failed (%s)", self.window, exc)
                return False
        added = False
        for key in keys:
            if key in self._seen:
                continue
            peer = self._peer_of(key)
            if peer is None or (self.trusted is not None and peer not in self.trusted):
                self._seen.add(key)
                continue
            part = self._fetch(key, peer)
            if part is not None:
                self._parts[peer] = part
                added = True
        if added:
            self.delta = self._aggregate()
        return added

    def _missing(self) -> list[str] | None:
        """The keys of the trusted peers' contributions not looked at yet (None: no trusted set)."""
        if self.trusted is None:
            return None
        keys = (layout.contrib_key(self.run, self.window, p) for p in sorted(self.trusted))
        return [k for k in keys if k not in self._seen]

    def _peer_of(self, key: str) -> str | None:
        try:
            parsed = layout.parse_key(key, run=self.run)
        except ProtocolError:
            return None
        ok = parsed.kind == "contrib" and parsed.window == self.window and parsed.peer_id
        return parsed.peer_id if ok else None

    def _fetch(self, key: str, peer: str) -> SparseDict | None:
        """The contribution at ``key`` in sparse form, or None when it does not pass (then it is
        never looked at again) or cannot be read now (then it is)."""
        cap = object_caps(self.spec).contribution  # what the validator reads with
        try:
            data = self.store.get(key, max_bytes=cap)
        except StoreError:
            return None  # missing for now, or a failing store: the next refresh tries again
        self._seen.add(key)
        try:
            verified = decode_contribution(
                data,
                run_hash=self.spec.hash(),
                max_bytes=cap,
                window=self.window,
                sender=peer,
                schema=self.schema,
                partial=True,
                codec_cfg=self.spec.codec_at(self.window),
            )
        except ProtocolError as exc:
            log.info("forecast of aggregate %d leaves %s out: %s", self.window, peer, exc)
            return None
        if verified.value.base not in self.bases:
            return None
        part = sparse_of(verified.value.tensors)
        if not all(bool(torch.isfinite(vals).all()) for _, vals in part.values()):
            return None
        return part

    def _aggregate(self) -> SparseDict:
        outer = self.spec.outer
        parts = [self._parts[p] for p in sorted(self._parts)]  # the validator's order: by peer id
        delta = aggregate(parts, outer.aggregation, outer.clip)
        # What the validator signs, and every peer applies, is Δ̄'s published form (bfloat16 values,
        # or re-compressed): forecast that form, so that an exact forecast is the aggregate bit for
        # bit. A re-compression buffer (outer.recompress_beta > 0) is the validator's own; then the
        # forecast starts from an empty one and is close, not exact.
        tensors, _ = publishable(
            delta, self.schema, outer, self.spec.codec, FeedbackState(), contributors=len(parts), window=self.window
        )
        return applied(tensors)


def same_delta(
    a: Mapping[str, tuple[torch.Tensor, torch.Tensor]], b: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
) -> bool:
    """Whether two sparse Δ̄ are the same bytes (same tensors, indices and float32 values)."""
    return a.keys() == b.keys() and all(
        torch.equal(a[n][0], b[n][0]) and torch.equal(a[n][1].float(), b[n][1].float()) for n in a
    )
