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
