"""Which engines there are: the names --engine takes (``ENGINES``) and the class each means
(``engine_class``). The registry sits one floor above the engines it names (the base
``aiayn.inference.engine``, aiayn's ``aiayn.inference.aiayn_engine`` and CTranslate2's
``aiayn.inference.ct2``), so that no engine's module imports another's.
"""

from __future__ import annotations

from aiayn.errors import AiaynError
from aiayn.inference.aiayn_engine import AiaynEngine
from aiayn.inference.ct2 import CTranslate2Engine
from aiayn.inference.engine import Engine
from aiayn.options import ENGINES  # the names --engine takes

_CLASSES: dict[str, type[Engine]] = {"aiayn": AiaynEngine, "ctranslate2": CTranslate2Engine}


def engine_class(name: str) -> type[Engine]:
    """The engine --engine ``name`` means (an AiaynError naming the choices)."""
    if name not in _CLASSES:
        raise AiaynError(f"--engine must be one of {', '.join(ENGINES)}, got {name!r}")
    return _CLASSES[name]
