"""The one exception type for mistakes a user can make (bad file, spec, setting, checkpoint).

The CLI prints its message as one line (``aiayn: error: ...``) and exits with status 2;
anything else that escapes is a bug in aiayn and keeps its traceback. A setting out of its
bounds is the kind ``SettingError``, whose message each edge (the command line, the HTTP
API) spells with its own names for the settings.
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


class SettingError(AiaynError, ValueError):
    """A setting refused, its message naming settings by their Python names in braces
    (``SettingError("{beam} must be at least 1, got {got}", got=0)``) so that each edge
    spells them as its users wrote them (``spelled``: `aiayn translate` ``--beam``, the HTTP
    API ``"beam"``). ``str()`` spells them as the Python keywords (``Translator.resolve``).
    A ValueError too: the value given is wrong, whoever gave it."""

    def __init__(self, template: str, **values):
        self.template, self.values = template, values
        super().__init__(self.spelled(str))

    def spelled(self, spell) -> str:
        """The message with each setting named ``spell(name)``."""
        return self.template.format_map(_Names(spell, self.values))


class _Names(dict):
    """The values of a ``SettingError``'s message, and the spelling of every other name."""

    def __init__(self, spell, values: dict):
        super().__init__(values)
        self.spell = spell

    def __missing__(self, name: str) -> str:
        return self.spell(name)
