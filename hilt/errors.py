"""The toolkit's one exception base class, in a module that imports nothing, so that every
package (kernels included) can raise it without import circles or import cost."""


class HiltError(Exception):
    """A user mistake or bad input: the message names the file, tensor or layer.

    The command line prints the message as one line and exits non-zero.
    """


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message as one line for a HiltError: whitespace collapsed, cut at ``limit``
    characters; the exception's type name when it has no message."""
    text = " ".join(str(e).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text or type(e).__name__
