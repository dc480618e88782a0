"""The one exception type for mistakes a user can make (bad file, spec, setting, checkpoint).

The CLI prints its message as one line (``aiayn: error: ...``) and exits with status 2;
anything else that escapes is a bug in aiayn and keeps its traceback.
"""


class AiaynError(Exception):
    """A problem with the user's input, described in one line that names what to fix."""


def is_out_of_memory(exc: BaseException) -> bool:
    """A CPU or GPU allocation failure (torch raises several kinds for it)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
        or type(exc).__name__ == "OutOfMemoryError")
