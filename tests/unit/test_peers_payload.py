"""The peers' notifications (peers.py): split under PostgreSQL's payload limit, our own and
malformed ones dropped."""

from __future__ import annotations

from effectledger_ledger.peers import PAYLOAD_MAX, ids_of, payload_of


def test_ids_go_out_in_as_few_notifications_as_fit_and_come_back_in_order() -> None:
    ids = [f"{i:032x}" for i in range(500)]  # 33 bytes each with its comma
    payloads = payload_of("abc", ids)
    assert len(payloads) == 3 and all(len(p.encode()) < PAYLOAD_MAX for p in payloads)
    assert [i for p in payloads for i in ids_of(p, "mine")] == ids
    assert payload_of("abc", []) == []


def test_our_own_and_malformed_notifications_name_no_operation() -> None:
    assert ids_of("mine:a,b", "mine") == []
    assert ids_of("no separator", "mine") == []
    assert ids_of("peer:", "mine") == []
    assert ids_of("peer:a,,b," + "z" * 65, "mine") == ["a", "b"]
