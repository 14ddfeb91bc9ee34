"""The exception family for problems with what a caller passed in (never for bugs).

``UserError`` is a ``ValueError``, so ``except ValueError`` keeps working; its message names the
offending value and says what to do instead. The command line (``cli/__init__.py``) prints a
``UserError`` as one line and exits with status 2; any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the caller (an argument, a file, a checkpoint), with the fix in the message."""
