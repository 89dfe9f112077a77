"""``sparseloco-validator dashboard``: the contribution log as web pages and a JSON API.

:mod:`~validator.dashboard.views` reads what is shown from the log (bounded queries),
:mod:`~validator.dashboard.svg` draws the charts, :mod:`~validator.dashboard.pages` writes the HTML,
:mod:`~validator.dashboard.server` serves both on a thread.
"""

from validator.dashboard.server import Dashboard, check_log

__all__ = ["Dashboard", "check_log"]
