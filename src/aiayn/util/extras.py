"""Optional dependencies: imported where they are needed, or one line saying what to install."""

from __future__ import annotations

from aiayn.errors import AiaynError


def require(module: str, purpose: str, extra: str = "export"):
    """Import an optional library or say in one line what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise AiaynError(f"{purpose} needs the Python package {module!r}, which is not "
                         f"installed: pip install 'aiayn[{extra}]'") from None
