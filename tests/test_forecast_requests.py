"""What the eager forecast (client/forecast.py) asks the bucket: a GET per missing trusted key while
that is cheaper than a LIST, a LIST for more, nothing once complete."""

from __future__ import annotations

from client.forecast import EXACT_READS, Forecast
from protocol import layout
from protocol.config import RunSpec
from protocol.identity import Identity
from protocol.store.memory import MemoryStore

TINY = {"preset": "tiny", "dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64, "max_seq_len": 32}
SPEC = RunSpec.from_dict({"model": TINY})
RUN = layout.run_id(SPEC.hash())


class Asked(MemoryStore):
    """A memory store that records every read it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[str, str]] = []

    def get(self, key: str, *, max_bytes: int = 1 << 30) -> bytes:
        self.asked.append(("GET", key))
        return super().get(key, max_bytes=max_bytes)

    def list(self, prefix: str) -> list[str]:
        self.asked.append(("LIST", prefix))
        return super().list(prefix)


def peers(n: int) -> list[str]:
    return sorted(Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(n))


def test_few_missing_contributions_are_read_by_their_keys_and_a_complete_forecast_asks_nothing() -> None:
    store, (p, q) = Asked(), peers(2)
    forecast = Forecast(SPEC, store, window=0, bases={"b" * 64}, trusted={p, q}, own=None)
    assert not forecast.refresh()
    keys = [layout.contrib_key(RUN, 0, peer) for peer in (p, q)]
    assert store.asked == [("GET", k) for k in keys]  # two 404s, no LIST
    store.put(keys[0], b"not a contribution")  # looked at once and left out (it does not decode)
    store.asked.clear()
    forecast.refresh()
    assert store.asked == [("GET", k) for k in keys] and not forecast.complete
    store.put(keys[1], b"junk too")
    store.asked.clear()
    forecast.refresh()
    assert store.asked == [("GET", keys[1])] and forecast.complete
    store.asked.clear()
    assert not forecast.refresh() and store.asked == []


def test_many_missing_contributions_are_listed() -> None:
    store = Asked()
    forecast = Forecast(SPEC, store, window=0, bases={"b" * 64}, trusted=peers(EXACT_READS + 1), own=None)
    forecast.refresh()
    assert store.asked == [("LIST", layout.contrib_prefix(RUN, 0))]  # nothing there: nothing fetched
    untrusted = Forecast(SPEC, store, window=0, bases={"b" * 64}, trusted=None, own=None)
    store.asked.clear()
    untrusted.refresh()
    assert store.asked == [("LIST", layout.contrib_prefix(RUN, 0))] and not untrusted.complete
