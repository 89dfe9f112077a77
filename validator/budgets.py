"""What one validator spends on a window: local settings, never part of the run's identity.

The swarm is permissionless, so anyone can list keys, announce identities and upload bytes at no
cost. These caps bound what that costs the validator, whatever the number of identities. They are
the ``budgets`` section of the local settings (:class:`protocol.settings.BudgetSettings`): run.toml's
``[local.budgets]``, a ``--settings`` file, ``SPARSELOCO_BUDGETS_*`` variables or the flags of
``sparseloco-validator run`` (``--max-fetches``, ``--max-fetch-bytes``, ``--fetch-timeout`` …)::

    Budgets(max_fetches=256, max_fetch_bytes=8 << 30, fetch_timeout_s=30.0)

* ``max_fetches`` contributions and ``max_fetch_bytes`` bytes are read per window, highest
  reputation first (uploads beyond are logged ``over_budget``, not held against the peer); only
  announced, non-excluded peers are read at all. Contributions are kept decoded (sparse), the
  bytes dropped as soon as they are checked, so memory is bounded by ``validator.gather_concurrency``
  objects in flight plus ``max_fetches`` decoded contributions.
* ``fetch_timeout_s``: how long reads listed before the window closed may still take.
* ``max_announcements_per_poll`` new announcements are read per poll, in an order derived from a
  secret (ground peer ids do not go first), and at most ``max_tracked_peers`` identities are
  tracked; when full, identities that never contributed and are older than the announcement TTL
  make room.
* ``newcomer_wait``: identities without uploads (just announced) keep a window open at most this
  fraction of the upload deadline, so announce-only identities cannot hold every window to it.
"""

from __future__ import annotations

from protocol.settings import BudgetSettings

__all__ = ["Budgets"]

Budgets = BudgetSettings
