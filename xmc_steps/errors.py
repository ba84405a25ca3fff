"""The one exception every layer may raise: a user-facing error.

It lives in its own module so that library code (readers, models, searches) can raise it
without importing the stage harness (`stage.py`), which sits above the library: the harness
catches it and prints it without a traceback.
"""


class StageError(Exception):
    """A user-facing error: bad input or configuration.  Printed without a traceback."""
