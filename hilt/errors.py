"""The toolkit's one exception base class, in a module that imports nothing, so that every
package (kernels included) can raise it without import circles or import cost."""


class HiltError(Exception):
    """A user mistake or bad input: the message names the file, tensor or layer.

    The command line prints the message as one line and exits non-zero.
    """
