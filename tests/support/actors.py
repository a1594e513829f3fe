"""An in-process stand-in for a Ray actor handle, for unit tests of code that calls actors."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["LocalActor"]


class LocalActor:
    """``handle.method.remote(*args)`` runs ``obj.method(*args)`` at once and returns an awaitable
    of its result, as awaiting an ObjectRef would."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._obj, name)

        class _Call:
            @staticmethod
            def remote(*args: Any) -> Any:
                done = asyncio.get_running_loop().create_future()
                done.set_result(fn(*args))
                return done

        return _Call
