"""The typed batched call: one transaction function's inputs, with a set-based form.

Apart from the group-commit engine (`batch.py`) that runs them, so the modules that define
calls (intents, claims, outcomes, the outbox's marks) depend on this contract only, not on
the engine, its store and its connection handling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Generic, Self, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection

R = TypeVar("R")


class BatchCall(Generic[R]):
    """A typed batched call: subclasses are frozen dataclasses of one call's inputs.

    `many` decides a whole batch of calls of its class together (set-based); `one` runs a
    single call alone in its transaction: first `alone` (one statement, where a class has
    such a form), else as a batch of one, raising the exception `many` refused it with.
    """

    __slots__ = ()
    # Someone holds a request open for calls of this class: they go ahead of background calls.
    urgent: ClassVar[bool] = False

    @classmethod
    async def many(cls, conn: AsyncConnection, calls: Sequence[Self]
                   ) -> Sequence[R | Exception]:
        raise NotImplementedError

    async def alone(self, conn: AsyncConnection) -> R | None:
        """The call done by one statement, when it is alone in its transaction; None: nothing
        written, and it is decided as a batch of one (`transitions.apply_alone`)."""
        return None

    async def one(self, conn: AsyncConnection) -> R:
        done = await self.alone(conn)
        if done is not None:
            return done
        [result] = await type(self).many(conn, [self])
        if isinstance(result, Exception):
            raise result
        return result
