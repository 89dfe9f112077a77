"""The peer: join a run, then train, compress, sign and upload one contribution per window.

    trainer = FullReplica(spec, data_key=identity.peer_id, device="cuda")   # or a pipeline StageTrainer
    peer = Peer(spec, store, identity, LocalState(dir), trainer, local=settings, display=PeerDisplay())
    peer.run(until_window=20)          # returns when θ opens window 20 (or on stop())

One iteration, as :meth:`Peer.run` reads it, for the next window t to train::

    catch_up    apply every published aggregate (verify, fingerprint check, resync on mismatch);
                wait only while θ is further behind t than the schedule allows (below)
    train       the trainer's H steps from the newest θ (θ_t, or θ_t−1 while aggregate t−1 is in
                flight), then Δ folded into e: Δ̂, e ← compress(e, Δ) in place; sign Δ̂
    upload      commit e and the signed bytes, then put contrib/<t>/<peer> — both on the background
                lane (client/lane.py) while the next window trains

**Overlap** (``outer.delay = 1``, the default): a peer does not wait for the aggregate of the window
it just sent. It trains window t while the validator gathers, scores and publishes window t−1,
starting from the newest θ it holds, θ_t−1. Between inner steps it looks for aggregate t−1; when it
is published the peer applies it to θ (bit-identical with everyone, as always: θ changes only by
signed aggregates) and moves its working model by the same step, and trains on; Δ is then taken
against θ_t and the contribution's ``base`` is aggregate t−1, as on the synchronous schedule. Once
``outer.overlap`` of the window's inner steps are done without it, the peer waits for it there
(bounding how much of a window is trained from the older θ; ``overlap = 1.0`` never waits, and a
window that ends first is sent with Δ against θ_t−1 and ``base`` one aggregate old, which the
validator applies to θ_t one window late). With ``outer.eager`` (the default) the working model
starts from θ_t−1 − α·Δ̄′ instead, Δ̄′ being aggregate t−1 as forecast from the window's
contributions already in the store, refreshed between steps (:mod:`client.forecast`); when the
validator accepts the same contributions the forecast is the aggregate, bit for bit, and its
arrival moves nothing. Δ is formed against θ as it stands at the fold, tensor by tensor, before
any later aggregate is applied (so θ is never held twice). A contribution is uploaded as soon as it
is staged, also before its window opens: the validator lists ``contrib/<t>/`` when it opens window t
and finds it there. A fresh peer that finds no genesis yet trains window 0 from θ₀ (a pure function
of the RunSpec) while it waits. With ``outer.delay = 0``, and for a trainer that cannot move its
working model mid-window (a pipeline stage), the peer waits for aggregate t−1 before it trains
window t.

How the peer trains is a :class:`~client.window.WindowTrainer` it holds: the whole model
(:class:`client.replica.FullReplica`) or one stage of a pipeline replica
(:class:`client.pipeline.trainer.StageTrainer`). Either returns the window's work as a value
(:class:`~client.window.Trained` or :class:`~client.window.Skipped`) and changes nothing the peer
owns; the peer decides what takes effect.

Memory. A full replica holds five copies of θ's size in steady state, host and device together:
the working model, θ (the base Δ is formed against), e and the two AdamW moments (plus the
gradients while it trains). Δ is never held whole (``Trained.fold`` forms it tensor by tensor into
e), e exists once (folded and given back in place), and the state directory is written tensor by
tensor (:mod:`client.state`).

Error feedback across failures. e changes only when a contribution is staged: the window's Δ is
folded into e once the peer knows it will send the window, and that e is committed with the signed
bytes before they are put (write-ahead), so a restart re-uploads exactly those bytes with exactly
that e.

* A window whose deadline passes before its Δ is folded into e (slow hardware, a stalled store, a
  pipeline stage that lost its group) is *skipped*: nothing was adopted, e keeps its pre-window
  value, and the window's Δ never enters e (it was computed against a θ the swarm moved past).
* A staged contribution whose put fails for good gives its Δ̂ back: e ← e′ + decode(Δ̂), which is
  β·e + Δ up to float rounding, i.e. what error feedback keeps when nothing is sent. The rule needs
  only what the commit holds (the staged bytes are Δ̂), so it applies unchanged to an upload
  resumed after a restart; restoring the pre-window e instead would need a second copy of e in the
  state directory. Either way e never loses mass that was not sent.
* A staged contribution that reached the store but is rejected or late, or whose window closed
  while the peer was down, loses its Δ̂ exactly as in production SparseLoCo: e already had it
  subtracted, and it may well have been sent.
* A restart in the middle of an overlapped window (the next window training while the last one's
  commit and put run on the lane) resumes from the last commit: a contribution staged there is
  re-put if its window is still open, a window that was training is trained again, and e is the
  one committed with the last staged contribution, never a half-folded one (e changes only on the
  main thread, after the lane has drained).

The inner optimizer's moments and step keep what training did, also in a skipped window: they
describe the local loss surface and carry nothing the swarm sees, and rolling them back would cost
a copy of the optimizer state (2× the parameters) every window. They reach the state directory
every ``peer.moments_every`` windows and when the peer stops (the step, which indexes the
learning-rate schedule, with every commit); a restart resumes the moments last written
(:mod:`client.state`).

Failures at a window boundary (store errors, bad aggregates, missed deadlines) become recorded
outcomes (a :class:`~protocol.events.PeerWindow` event with ``outcome`` and ``reason``). What stops
the peer: configuration and identity errors; no genesis checkpoint of its run hash within
``peer.join_timeout_s`` (:class:`RunNotFound`: its run.toml differs from the operator's, or the
validator is not up; a store that does not answer yet, such as a grant server whose validator is
starting, is waited for within the same bound); and ``peer.max_upload_failures`` consecutive
contributions the store refused while reads work (:class:`UploadsRefused`: a credential that may
read but not write, so training on would only stall the run).

Leaving. However :meth:`Peer.run` ends once the peer has announced (done, :meth:`stop`, Ctrl-C,
one of the errors above), it replaces its announcement by a signed withdrawal: the validator stops
waiting for this peer at once instead of holding the next window open until its deadline.

The package, one module per phase, each owning its state (:class:`Peer` only decides what comes
next and holds them together):

* :mod:`client.peer.loop`: :class:`Peer`, the loop above, the training of one window and its fold;
* :mod:`client.peer.lifecycle`: joining (announce, restore local state, wait for genesis, replay)
  and leaving (the signed withdrawal);
* :mod:`client.peer.position`: θ's master copy and where it stands (:class:`~client.peer.position.Theta`),
  and catching up with the chain between windows and mid-window, reported
  (:class:`~client.peer.position.CatchUp`); :mod:`client.peer.sync` reads the chain and yields
  each change to θ as a value;
* :mod:`client.peer.inflight`: the window in training: the stand-in, the forecast, the aggregate
  that arrives mid-window, an abandoned window, and the one call the trainer makes between steps;
* :mod:`client.peer.uploads`: e, the staged contribution, the lane, the put and its outcome
  (:class:`~client.peer.uploads.PutOutcome`), refusals and the give-back;
* :mod:`client.peer.context`: what every phase works with and none owns (run, store, key, state
  directory, trainer, settings, display, the request to stop).

A new phase is one more module here: a class built from the :class:`~client.peer.context.PeerContext`
and the phases whose state it reads (through their methods and public fields), owning its own
state and answering with values rather than callbacks; :class:`Peer` builds it in ``__init__`` and
calls it from :meth:`Peer.run` (or from the phase that drives it, as
:meth:`~client.peer.inflight.InFlight.between_steps` drives :class:`~client.peer.position.CatchUp`
mid-window).
"""

from client.peer.lifecycle import CLIENT_VERSION, RunNotFound
from client.peer.loop import Peer
from client.peer.uploads import PutOutcome, Staged, UploadsRefused

__all__ = ["CLIENT_VERSION", "Peer", "PutOutcome", "RunNotFound", "Staged", "UploadsRefused"]
