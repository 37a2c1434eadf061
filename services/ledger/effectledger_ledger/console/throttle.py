"""Console sign-in throttling: exponential backoff after failed sign-ins, per client address and
per token (or, in open mode, per name).

Without it, 300 wrong tokens took 0.8 s and the right one still worked at once. Now each key
may fail `free_failures` times; every further failure blocks that key for twice as long as the
one before (`base_s`, doubled, capped at `max_s`), and while a key is blocked the sign-in is
refused with 429 before the token is even compared, so guessing through the block learns
nothing. Failures are forgotten `forget_after_s` after the last one.

Both keys count, and the longer block wins: the address stops one client guessing many tokens,
the token key stops many addresses trying the same one. A success clears the token's key but
not the address's, so a holder of one (agent) token cannot sign in between guesses to reset
its address. Tokens are keyed by a keyed hash (`fingerprint`), never stored.

In memory, like the sessions: a restarted ledger forgets the counts, and at most `max_keys`
keys are kept (the longest-quiet go first).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

FREE_FAILURES = 5  # typos: the first failures cost nothing
BASE_S = 1.0
MAX_S = 300.0
FORGET_AFTER_S = 3600.0
MAX_KEYS = 50_000


@dataclass
class _Failures:
    count: int
    last_at: float
    blocked_until: float


@dataclass(frozen=True)
class Blocked:
    retry_after_s: float
    key: str  # "address" or "token" (or "name"): which one is blocked, for the message


class SignInThrottle:
    def __init__(self, *, free_failures: int = FREE_FAILURES, base_s: float = BASE_S,
                 max_s: float = MAX_S, forget_after_s: float = FORGET_AFTER_S,
                 max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.free_failures, self.base_s, self.max_s = free_failures, base_s, max_s
        self.forget_after_s, self.max_keys = forget_after_s, max_keys
        self.clock = clock
        self._keys: OrderedDict[str, _Failures] = OrderedDict()
        self._secret = secrets.token_bytes(32)  # per process: fingerprints never leave it

    def fingerprint(self, kind: str, secret: str) -> str:
        """A key for a token or name that does not reveal it (and cannot be precomputed)."""
        digest = hmac.new(self._secret, secret.strip().encode("utf-8", "surrogatepass"),
                          hashlib.sha256).hexdigest()
        return f"{kind}:{digest[:32]}"

    def blocked(self, keys: dict[str, str]) -> Blocked | None:
        """The longest block among `keys` ({"address": key, "token": key}), if any."""
        now = self.clock()
        worst: Blocked | None = None
        for label, key in keys.items():
            state = self._current(key, now)
            if state is not None and state.blocked_until > now:
                wait = state.blocked_until - now
                if worst is None or wait > worst.retry_after_s:
                    worst = Blocked(wait, label)
        return worst

    def failed(self, keys: dict[str, str]) -> None:
        now = self.clock()
        for key in keys.values():
            state = self._current(key, now) or _Failures(0, now, now)
            state.count += 1
            state.last_at = now
            over = state.count - self.free_failures
            if over > 0:
                # The exponent is bounded: a float cannot hold 2 ** 1024.
                delay = self.base_s * 2.0 ** min(over - 1, 40)
                state.blocked_until = now + min(self.max_s, delay)
            self._keys[key] = state
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)  # the longest-quiet key

    def succeeded(self, key: str) -> None:
        self._keys.pop(key, None)

    def _current(self, key: str, now: float) -> _Failures | None:
        state = self._keys.get(key)
        if state is not None and now - state.last_at > self.forget_after_s \
                and state.blocked_until <= now:
            del self._keys[key]
            return None
        return state

    def __len__(self) -> int:
        return len(self._keys)
