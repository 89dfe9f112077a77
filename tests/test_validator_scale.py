"""What keeps one validator window linear in the peers and constant in history, held to the old results.

The sparse sum built batch by batch gives the bytes of :func:`protocol.aggregate.aggregate`; a
held contribution decodes to the values screened and its sample follows the clip; the keyed sample
picks the same positions of every contribution; a log row packs its checks into one column and
reads them back; the standings saved with the state are those the whole log folds to; θ is written
only at checkpoint windows and a restart replays the aggregates since.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from protocol.aggregate import NormLimit, SparseDict, SparseSum, aggregate, clip_to_limits
from protocol.identity import Identity
from protocol.model import build_model, fingerprint, parameters_of
from tests.validator_fixtures import LOCAL, Swarm, tiny_spec
from validator.held import Held, clipped_entries, decode, decoded
from validator.log import CheckRow, ContributionLog, ContributionRecord, WindowRecord, pack_checks, unpack_checks
from validator.logview import LogView
from validator.node import Validator
from validator.sketch import Sketcher, global_entries, offsets, sample_every
from validator.state import load_state

pytestmark = pytest.mark.timeout(120)

SHAPES = {"a": (8, 16), "b": (32,), "c": (4, 4, 4)}


def random_sparse(gen: torch.Generator, density: float = 0.3) -> SparseDict:
    out: SparseDict = {}
    for name, shape in SHAPES.items():
        numel = int(np.prod(shape))
        keep = torch.rand(numel, generator=gen) < density
        idx = torch.nonzero(keep).squeeze(1)
        out[name] = (idx, torch.randn(len(idx), generator=gen))
    return out


@pytest.mark.parametrize("mode", ["contributors", "all"])
def test_sparse_sum_batch_by_batch_is_the_aggregate_byte_for_byte(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    contribs = [random_sparse(gen) for _ in range(7)]
    contribs[3].pop("b")  # a contribution that leaves a tensor out
    expected = aggregate(contribs, mode, "none")
    total = SparseSum(SHAPES)
    with ThreadPoolExecutor(3) as pool:
        for k in range(0, len(contribs), 3):
            total.add(contribs[k : k + 3], pool)
    got = total.mean(mode)
    assert sorted(got) == sorted(expected)
    for name, (idx, vals) in expected.items():
        assert torch.equal(got[name][0], idx) and torch.equal(got[name][1], vals)


def test_checks_pack_into_a_mask_and_unusual_ones_stay_rows() -> None:
    passed = (CheckRow("size", True), CheckRow("signature", True), CheckRow("norm", True))
    failed = (*passed, CheckRow("copy", False, "copy"))
    assert pack_checks(passed, None) is not None
    assert unpack_checks(*pack_checks(passed, None), None) == passed  # type: ignore[misc]
    mask, name = pack_checks(failed, "copy")  # type: ignore[misc]
    assert name == "copy" and unpack_checks(mask, name, "copy") == failed
    assert pack_checks((CheckRow("norm", True), CheckRow("size", True)), None) is None  # out of order
    assert pack_checks((CheckRow("custom", True),), None) is None  # not a known check
    assert pack_checks((CheckRow("norm", False, "a"), CheckRow("copy", False, "b")), "a") is None  # two failed

    log = ContributionLog(":memory:")
    odd = (CheckRow("custom", True), CheckRow("size", False, "too big"))
    rows = [
        ContributionRecord(window=0, peer="p1", accepted=True, weight=1.0, checks=passed),
        ContributionRecord(window=0, peer="p2", reason="copy", checks=failed),
        ContributionRecord(window=0, peer="p3", reason="too big", checks=odd),
    ]
    log.record_window(WindowRecord(window=0), rows)
    assert log.rows(windows=(0, 0)) == rows
    assert LogView(log).history("p3", limit=5) == [rows[2]] and LogView(log).history("p2", limit=5) == [rows[1]]
    log.close()


def test_the_sample_is_the_same_positions_of_every_contribution() -> None:
    gen = torch.Generator().manual_seed(2)
    offs = offsets(SHAPES)
    a, b = random_sparse(gen, 0.5), random_sparse(gen, 0.5)
    exact = Sketcher(offs)
    assert all(np.array_equal(x, y) for x, y in zip(exact.entries(a), global_entries(a, offs)))
    sk = Sketcher(offs, every=4, key=b"secret")
    (ia, va), (ib, _) = sk.entries(a), sk.entries(b)
    full_a, full_b = global_entries(a, offs)[0], global_entries(b, offs)[0]
    assert np.array_equal(ia, full_a[sk.sampled(full_a)])  # exactly the sampled positions it kept
    assert np.array_equal(
        np.intersect1d(ia, ib), np.intersect1d(full_a, full_b)[sk.sampled(np.intersect1d(full_a, full_b))]
    )
    assert 0 < len(ia) < len(full_a) and len(va) == len(ia)
    other = Sketcher(offs, every=4, key=b"another secret").entries(a)[0]
    assert not np.array_equal(ia, other)  # the window's secret picks the positions
    assert sample_every(1000, keep=100) == 8 and sample_every(50, keep=100) == 1
    with pytest.raises(ValueError):
        Sketcher(offs, every=3)


@pytest.fixture()
def vkey() -> Identity:
    return Identity.generate()


@pytest.fixture()
def swarm(vkey: Identity) -> Iterator[Swarm]:
    sw = Swarm(tiny_spec(vkey), 2)
    sw.announce_all()
    yield sw
    sw.close()


def test_a_held_contribution_decodes_again_and_its_sample_follows_the_clip(swarm: Swarm) -> None:
    params = {n: p.detach().clone() for n, p in parameters_of(build_model(swarm.spec.model)).items()}
    tensors = swarm.encode(swarm.delta(swarm.peers[0], params, 0), 0)
    h = swarm.held(swarm.peers[0], 0, "ab" * 32, tensors)
    sparse = decode(h, swarm.schema, swarm.spec.codec_at(0))
    assert sorted(sparse) == sorted(swarm.schema)
    offs = offsets(swarm.schema)
    idx, vals = global_entries(sparse, offs)
    assert np.array_equal(h.sketch[0], idx) and np.array_equal(h.sketch[1], vals)  # small: not sampled
    assert h.nnz == len(idx)

    # caps at half of every tensor's norm, and a row cap on the matrices: the sample clipped from the
    # norms alone is the sample of the clipped values
    limits = {}
    for name, m in h.norms.tensors.items():
        shape = swarm.schema[name]
        row_len = int(np.prod(shape[1:])) if len(shape) > 1 else 0
        limits[name] = NormLimit(norm=m.norm / 2, row=m.norm / 8 if row_len else 0.0, row_len=row_len)
    sk = Sketcher(offs)
    got = clipped_entries(h, limits, sk, swarm.schema)
    want = sk.entries(clip_to_limits([sparse], limits)[0])
    assert np.array_equal(got[0], want[0]) and np.allclose(got[1], want[1], rtol=1e-5, atol=1e-9)


def test_decoded_keeps_the_order_and_only_a_few_in_flight() -> None:
    lock, live, most = threading.Lock(), [0], [0]

    def work(peer: str, h: Held) -> SparseDict:
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        time.sleep(0.001 * (int(peer) % 3))  # uneven work: later items may finish first
        return {"p": (torch.tensor([int(peer)]), torch.zeros(1))}

    items = [(str(i), None) for i in range(20)]
    out = []
    with ThreadPoolExecutor(4) as pool:
        for peer, sparse in decoded(items, work, pool, ahead=3):  # type: ignore[arg-type]
            out.append(peer)
            assert int(sparse["p"][0]) == int(peer)
            with lock:
                live[0] -= 1
    assert out == [str(i) for i in range(20)]
    assert most[0] <= 4  # what is held: ``ahead`` computed plus the one being used


def test_standings_are_saved_folded_and_theta_written_only_at_checkpoints(
    swarm: Swarm, vkey: Identity, tmp_path
) -> None:
    v = Validator(swarm.spec, swarm.handle(), vkey, tmp_path, local=LOCAL)  # checkpoint_every = 2
    v.resume()
    fps = []
    for w in range(3):
        assert v.state is not None
        for p in swarm.peers:
            swarm.upload(p.peer_id, w, swarm.honest(p, v.state.params, w, v.state.base))
        report = v.run_window()
        assert report is not None and report.accepted == 2
        fps.append(report.fingerprint)
        saved = load_state(tmp_path, swarm.run_hash)
        assert saved is not None and saved.window == w + 1
        assert saved.params_window == (2 if w + 1 >= 2 else 0)  # θ on disk: genesis, then window 2
        assert saved.standings == v._folded(w + 1)  # the incremental fold is the whole log's
    v.close()

    again = Validator(swarm.spec, swarm.handle(), vkey, tmp_path, local=LOCAL)
    state = again.resume()  # θ of window 2 plus aggregate 2, replayed from the store
    assert state.window == 3 and fingerprint(state.params) == fps[-1]
    again.close()
