"""The compiled helper (``_native.c``), where it was built; None where not.

A first load reads and checks a store entry, then makes three or four driver calls; a launch writes
its changing arguments, then makes two or three. Made from Python, each step is a chain of calls
costing as much as the work; the helper makes each one call (``read_entry`` for
``LocalLayer.read_verified``, ``load_functions`` for the driver's load, ``launch`` for
``PreparedLaunch`` and ``Kernel.launch``). It is an
optional extension: ``pip install`` builds it where a C compiler and Python's headers are found,
and without it (or with ``CUBINSTORE_NATIVE=0``) the Python paths do the same work. Its functions
decide nothing: the callers pass every rule and take their Python path for anything but success.
"""

from __future__ import annotations

from types import ModuleType

from cubinstore._core import knobs as _env

__all__ = ["helper", "built"]

_module: ModuleType | None | bool = None  # False: not built


def built() -> ModuleType | None:
    """The extension module if it was built for this Python, whatever ``CUBINSTORE_NATIVE`` says."""
    global _module
    if _module is None:
        try:
            from cubinstore._core import _native  # type: ignore[attr-defined]
        except ImportError:
            _module = False
        else:
            _module = _native
    return _module or None


def helper() -> ModuleType | None:
    """The extension module, unless ``CUBINSTORE_NATIVE`` is off or it was not built. Callers ask
    once per object (a store layer, the driver) and keep the answer."""
    return built() if _env.native() else None
