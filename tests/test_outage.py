"""A store outage during a window: one summary instead of a line per failed request, reads retried
after the close, no URL query string in any error message (:mod:`validator.outage`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from protocol import layout
from protocol.errors import StoreError, StoreUnavailable, strip_queries
from protocol.events import Event, StoreErrors, WindowPublished, describe
from protocol.identity import Identity
from tests.validator_fixtures import LOCAL, Swarm, tiny_spec
from validator.node import Validator
from validator.outage import LIST_CONTRIBUTIONS, READ_CONTRIBUTION, StoreTrouble


@pytest.fixture(scope="module")
def vkey() -> Identity:
    return Identity.generate()


@pytest.fixture()
def swarm(vkey: Identity) -> Iterator[Swarm]:
    sw = Swarm(tiny_spec(vkey, windows={"upload_deadline_s": 30.0}), 3)
    sw.announce_all()
    yield sw
    sw.close()


def _validator(sw: Swarm, vkey: Identity, state_dir: object, events: list[Event]) -> Validator:
    v = Validator(sw.spec, sw.handle(), vkey, str(state_dir), local=LOCAL, emit=events.append)
    v.resume()
    return v


def _theta0(v: Validator) -> dict:
    return {n: p.detach().clone() for n, p in v.model.named_parameters()}


def _validator_with_uploads(sw: Swarm, vkey: Identity, state_dir: object, events: list[Event]) -> Validator:
    """A validator at window 0 with an honest upload of every peer in the store."""
    v = _validator(sw, vkey, state_dir, events)
    assert v.state is not None
    params = _theta0(v)
    for p in sw.peers:
        sw.upload(p.peer_id, 0, sw.honest(p, params, 0, v.state.base))
    return v


def test_strip_queries_keeps_scheme_host_and_path_only() -> None:
    presigned = "https://bucket.s3.example.com/run/contrib/7/peer?X-Amz-Signature=deadbeef&X-Amz-Credential=AK"
    assert strip_queries(f'cannot PUT "{presigned}": timed out') == (
        'cannot PUT "https://bucket.s3.example.com/run/contrib/7/peer?…": timed out'
    )
    assert strip_queries("http://127.0.0.1:8333/b?list-type=2&prefix=x and http://h/p") == (
        "http://127.0.0.1:8333/b?… and http://h/p"
    )
    assert strip_queries("no url? none here") == "no url? none here"
    # every store error is built without them, whatever raised it
    err = StoreUnavailable(f"Could not connect to the endpoint URL: {presigned}")
    assert "Signature" not in str(err) and "X-Amz" not in repr(err)
    assert "deadbeef" not in str(StoreError(presigned))


def test_store_trouble_counts_by_kind_and_says_whether_the_store_came_back() -> None:
    now = [100.0]
    trouble = StoreTrouble(clock=lambda: now[0])
    assert trouble.summary(3) is None
    trouble.answered()  # successes before any failure say nothing
    assert trouble.summary(3) is None
    for i in range(4):
        now[0] = 101.0 + i
        trouble.failed(LIST_CONTRIBUTIONS, StoreUnavailable("http://h/b?list-type=2 refused"), "run/contrib/3/")
    trouble.failed(READ_CONTRIBUTION, StoreError("reset"), "run/contrib/3/p")
    s = trouble.summary(3)
    assert s is not None and not s.recovered
    assert s.failed == {LIST_CONTRIBUTIONS: 4, READ_CONTRIBUTION: 1}
    assert s.reasons == {"unavailable": 4, "store_error": 1}
    assert (s.first_at, s.last_at) == (101.0, 104.0)
    assert s.detail.startswith("run/contrib/3/p") and "?" not in s.detail
    now[0] = 110.0
    trouble.answered()
    s = trouble.summary(3)
    assert s is not None and s.recovered
    line = describe(s)
    assert "5 store request(s) failed" in line and "answered again" in line and "list-type" not in line
    trouble.reset()
    assert trouble.summary(4) is None


def test_an_outage_within_a_window_costs_no_upload_and_logs_one_summary(
    swarm: Swarm, vkey: Identity, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every listing and read fails for a while (the store is out), then the store is back: the
    window still counts all three uploads, and the validator says so once (one ``store_errors``
    event, recovered), with no warning line per failed request."""
    events: list[Event] = []
    v = _validator_with_uploads(swarm, vkey, tmp_path, events)
    faults = v.store.faults  # type: ignore[attr-defined]
    faults.fail(swarm.run, ops=("list", "get", "size"), times=60, error=StoreUnavailable)
    with caplog.at_level(logging.INFO):
        report = v.run_window()
    assert report is not None and report.accepted == 3, v.log.rows()
    assert len([f for f in faults.fired if f[0] == "fail"]) == 60
    summaries = [e for e in events if isinstance(e, StoreErrors)]
    assert len(summaries) == 1 and summaries[0].window == 0 and summaries[0].recovered
    assert sum(summaries[0].failed.values()) >= 30  # the listings of each poll, the announcements …
    assert summaries[0].reasons == {"unavailable": sum(summaries[0].failed.values())}
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("validator")]
    assert noisy == [], [r.getMessage() for r in noisy]
    assert isinstance(events[-1], WindowPublished)
    v.close()


def test_reads_that_fail_at_the_close_are_retried_while_reads_may_finish(
    swarm: Swarm, vkey: Identity, tmp_path
) -> None:
    """Every expected peer's key is listed, so the window closes at once, but the store fails the
    reads of their bytes a few times: the reads are tried again after the close with backoff (they
    were lost as ``store_error`` before) and every upload counts."""
    events: list[Event] = []
    v = _validator_with_uploads(swarm, vkey, tmp_path, events)
    faults = v.store.faults  # type: ignore[attr-defined]
    faults.fail(layout.contrib_prefix(swarm.run, 0), ops=("size", "get"), times=9)
    report = v.run_window()
    assert report is not None and report.accepted == 3, v.log.rows()
    (summary,) = [e for e in events if isinstance(e, StoreErrors)]
    assert summary.failed == {READ_CONTRIBUTION: 9} and summary.recovered
    v.close()


class _Theta:
    """A peer's θ whose store stops answering (or serves a bad object) while it reads the chain."""

    def __init__(self, exc: Exception) -> None:
        from protocol.replay import Position

        self.pos, self.exc, self.diverged, self.poll_s = Position(4, "b" * 64, "f" * 64), exc, False, 1.0

    def advance(self) -> Iterator[object]:
        raise self.exc
        yield  # a generator, like Theta.advance

    def failed(self, exc: Exception) -> None:
        from client.peer.position import Theta

        Theta.failed(self, exc)  # type: ignore[arg-type]


def test_a_store_outage_mid_window_does_not_abandon_the_peers_window() -> None:
    """A peer training a window looks for the aggregate that opens it between inner steps; the
    store not answering then leaves θ where it was (nothing applied, look again later) and is one
    outage, said once, where it used to abandon the window. A bad object still does: θ must be
    rebuilt."""
    from types import SimpleNamespace

    from client.peer.context import Outage
    from client.peer.position import CatchUp
    from protocol.errors import MalformedPayload
    from protocol.events import SyncFailed

    emitted: list[Event] = []
    moved: list[int] = []
    display = SimpleNamespace(emit=emitted.append, update=lambda **_: None)
    ctx = SimpleNamespace(display=display, outage=Outage(display))  # type: ignore[arg-type]
    uploads = SimpleNamespace(moved=moved.append)
    out = CatchUp(ctx, _Theta(StoreUnavailable("http://h/b?X-Amz-Signature=s refused")), uploads)  # type: ignore[arg-type]
    assert out.in_window() == []
    assert moved == [4] and ctx.outage.since is not None and emitted == []
    assert out.in_window() == []  # within poll_interval_s: no second look, no second line
    bad = CatchUp(ctx, _Theta(MalformedPayload("junk")), uploads)  # type: ignore[arg-type]
    assert bad.in_window() is None
    (failed,) = emitted
    assert isinstance(failed, SyncFailed) and failed.reason == "malformed"


def test_a_peer_waiting_for_an_aggregate_looks_again_when_the_store_does_not_answer(vkey: Identity) -> None:
    """A peer waiting for the aggregate (mid-window, at the overlap point) keeps looking through an
    outage instead of failing the window it trains."""
    from client.peer.sync import Sync
    from protocol.store.memory import MemoryStore

    sync = Sync(tiny_spec(vkey), MemoryStore("outage-wait"), poll_interval_s=0.001)
    answers = iter([StoreUnavailable("down"), StoreUnavailable("down"), False, True])
    looks: list[int] = []

    def published(window: int, base: str | None = None) -> bool:
        looks.append(window)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    sync.aggregate_published = published  # type: ignore[method-assign]
    assert sync.wait_until_published(3) is True
    assert looks == [3, 3, 3, 3]
    MemoryStore.forget("outage-wait")
