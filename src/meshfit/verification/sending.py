"""What verify sends to its worker processes (the build function, the loss, the options,
the batch: by pickle) checked up front, so that what cannot travel is refused by name
before any worker starts."""

from __future__ import annotations

import pickle
import sys
import types
from typing import Any

from meshfit.errors import MeshfitError
from meshfit.verification.targets import _Objects


class _Interactive(Exception):
    pass


class _Probe(pickle.Pickler):
    """Pickles to nowhere, to find what the workers could not receive: what pickle
    refuses, and functions or classes of an interactive __main__ (a notebook cell),
    which pickle by name but which a worker cannot import."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        main = sys.modules.get("__main__")
        self.interactive = not getattr(main, "__file__", None)

    def reducer_override(self, obj: Any) -> Any:
        if (
            self.interactive
            and isinstance(obj, (type, types.FunctionType))
            and getattr(obj, "__module__", None) == "__main__"
        ):
            raise _Interactive(getattr(obj, "__qualname__", repr(obj)))
        return NotImplemented


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _check_sendable(source: _Objects, batch: Any) -> None:
    """Refuse, up front and by name, what cannot travel to the worker processes."""
    items = [("build", source.build), ("loss_fn", source.loss_fn)]
    items += [(name, value) for name, value in source.options.items()]
    items.append(("batch", batch))
    fix = (
        "define it with def at the top level of a .py module and import it (not a lambda, "
        "a nested function or a notebook cell), or use functools.partial of such a function"
    )
    for name, value in items:
        try:
            _Probe().dump(value)
        except _Interactive as exc:
            raise MeshfitError(
                f"{name}: {exc} is defined interactively (a notebook cell or the REPL), so "
                f"the worker processes cannot import it; {fix}"
            ) from None
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise MeshfitError(
                f"{name} cannot be sent to the worker processes ({exc}); {fix}"
            ) from None
