"""The toolkit's one exception base class.

It lives in `kernels`, the lowest package, so every package can raise it
without import circles (shared/DESIGN.md, "Which way imports go").
"""


class HiltError(Exception):
    """A user mistake or bad input: the message names the file, tensor or layer.

    The command line prints the message as one line and exits non-zero.
    """
