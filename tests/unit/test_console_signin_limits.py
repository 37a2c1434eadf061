"""The console's sign-in limits on their own: the throttle's backoff per key (fake clock) and
the session store's per-principal cap, where an agent never ends an operator's session."""

from __future__ import annotations

import pytest

from effectledger_ledger.auth import Principal
from effectledger_ledger.console.sessions import SessionsFull, SessionStore
from effectledger_ledger.console.throttle import SignInThrottle

ALICE = Principal("operator", "alice")
BOB = Principal("operator", "bob")
AGENT = Principal("agent", "agent:t1", "t1")
OTHER_AGENT = Principal("agent", "agent:t2", "t2")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def throttle(clock: Clock) -> SignInThrottle:
    return SignInThrottle(free_failures=3, base_s=1.0, max_s=10.0, forget_after_s=100.0,
                          max_keys=4, clock=clock)


def test_free_failures_then_a_doubling_block_capped() -> None:
    clock = Clock()
    t = throttle(clock)
    keys = {"address": "address:a"}
    waits = []
    for _ in range(9):
        assert t.blocked(keys) is None
        t.failed(keys)
        blocked = t.blocked(keys)
        waits.append(blocked.retry_after_s if blocked else 0.0)
        clock.now += waits[-1]
    assert waits == [0, 0, 0, 1, 2, 4, 8, 10, 10]


def test_the_longest_block_wins_and_says_which_key() -> None:
    clock = Clock()
    t = throttle(clock)
    for _ in range(5):
        t.failed({"address": "address:a", "token": "token:x"})
    t.failed({"address": "address:a"})
    blocked = t.blocked({"address": "address:a", "token": "token:x"})
    assert blocked is not None and blocked.key == "address" and blocked.retry_after_s == 4.0
    blocked = t.blocked({"address": "address:fresh", "token": "token:x"})
    assert blocked is not None and blocked.key == "token" and blocked.retry_after_s == 2.0


def test_success_clears_only_its_key_and_quiet_keys_are_forgotten() -> None:
    clock = Clock()
    t = throttle(clock)
    keys = {"address": "address:a", "token": "token:x"}
    for _ in range(4):
        t.failed(keys)
    t.succeeded("token:x")
    assert t.blocked({"token": "token:x"}) is None
    assert t.blocked({"address": "address:a"}) is not None  # the address still waits
    clock.now += 101.0
    assert t.blocked(keys) is None
    t.failed(keys)
    assert t.blocked(keys) is None  # counting starts again


def test_keys_are_bounded_and_a_long_siege_cannot_overflow_the_backoff() -> None:
    clock = Clock()
    t = throttle(clock)
    for n in range(10):
        t.failed({"address": f"address:{n}"})
    assert len(t) == 4  # the longest-quiet keys went first
    for _ in range(5000):
        t.failed({"address": "address:siege"})
    blocked = t.blocked({"address": "address:siege"})
    assert blocked is not None and blocked.retry_after_s == 10.0


def test_fingerprints_do_not_reveal_the_token_and_differ_per_process() -> None:
    a, b = SignInThrottle(), SignInThrottle()
    fp = a.fingerprint("token", "tok-operator-alice")
    assert "tok-operator-alice" not in fp and fp.startswith("token:")
    assert fp == a.fingerprint("token", " tok-operator-alice ")  # as the sign-in strips it
    assert fp != b.fingerprint("token", "tok-operator-alice")
    assert a.fingerprint("token", "\ud800")  # an unpaired surrogate from a form is a key too


def test_an_agent_never_ends_an_operators_session() -> None:
    """Before: the oldest sign-in went first, whoever it was."""
    store = SessionStore(max_sessions=3, max_per_principal=10)
    alice = store.create(ALICE)
    for _ in range(10):
        store.create(AGENT)
        store.create(OTHER_AGENT)
    assert store.get(alice.id) is alice and len(store) == 3


def test_each_principal_keeps_only_its_own_newest_sessions() -> None:
    store = SessionStore(max_sessions=100, max_per_principal=2)
    alice = store.create(ALICE)
    first, *_, last = [store.create(AGENT) for _ in range(5)]
    assert store.of(AGENT) == 2 and store.get(first.id) is None and store.get(last.id) is last
    assert store.get(alice.id) is alice


def test_when_full_of_operators_an_agent_is_refused_and_an_operator_ends_the_oldest() -> None:
    store = SessionStore(max_sessions=2, max_per_principal=5)
    alice, bob = store.create(ALICE), store.create(BOB)
    with pytest.raises(SessionsFull):
        store.create(AGENT)
    assert store.get(alice.id) is alice and store.get(bob.id) is bob
    carol = store.create(Principal("operator", "carol"))
    assert store.get(alice.id) is None and store.get(carol.id) is carol


def test_expired_sessions_make_room_before_anyone_is_ended() -> None:
    clock = Clock()
    store = SessionStore(ttl_s=10, max_sessions=2, clock=clock)
    old = store.create(ALICE)
    clock.now = 5.0
    bob = store.create(BOB)
    clock.now = 11.0  # alice's session expired, bob's not
    store.create(AGENT)
    assert store.get(bob.id) is bob and store.get(old.id) is None
