"""User-facing errors.

Every problem a user can cause (bad option, missing file, wrong model kind) raises
:class:`UnmaskError` with a one-line message that names the problem and the fix. The CLI
prints the message and exits with code 2, never a traceback.
"""


class UnmaskError(ValueError):
    """A one-line, user-facing error: what is wrong and how to fix it."""
