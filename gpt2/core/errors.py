"""The one exception type that means "the user can fix this".

Stages and the CLI catch :class:`UserError`, print its message on one line and
exit non-zero; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with input, params or environment that the user can fix.

    The message must name the cause and the fix, e.g.
    ``download.source: no such file 'corpus.txt'; point it at an existing file``.
    """

    exit_code = 2
    every_rank = True  # under torchrun each rank says it; False: rank 0 alone (every rank has the same news)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that the same clean-up runs (temporaries removed,
    child processes stopped) instead of Python's default of dying on the spot."""

    signum = 15


class Stopped(UserError):
    """A run stopped on purpose (Ctrl-C or SIGTERM, with its work saved): tracked as KILLED, not FAILED."""


class Diverged(UserError):
    """The loss, or the weights after an update, became NaN or infinite."""
