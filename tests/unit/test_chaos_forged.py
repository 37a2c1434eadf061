"""The proving ground's eleventh invariant over issue 28's two attacks, from final state alone:
a forged webhook kept but marked refused can never be applied (not counted), one stored
otherwise can (counted); a ledger answer written into a stream is a dead letter naming the
reply attack's made-up operation (counted)."""

from __future__ import annotations

from typing import Any

from effectledger_chaos.checker import REPLY_MARK, forged_effects


def _db(**tables: list[dict[str, Any]]) -> dict[str, Any]:
    return {"journal": [], "attempts": [], "webhook_events": [], "operations": [],
            "dead_letters": [], **tables}


def test_a_refused_forged_webhook_is_not_counted_and_any_other_stored_one_is() -> None:
    hooks = [{"webhook_id": "forged-unbound-1-0", "operation_id": "o1",
              "applied": "refused:provider_not_bound"},
             {"webhook_id": "forged-unbound-1-1", "operation_id": "o2", "applied": None},
             {"webhook_id": "forged-unbound-1-2", "operation_id": "o3", "applied": "applied"},
             {"webhook_id": "wh-real", "operation_id": "o4", "applied": "applied"}]
    found = forged_effects(_db(webhook_events=hooks), {}, [])
    assert [f["webhook_id"] for f in found] == ["forged-unbound-1-1", "forged-unbound-1-2"]


def test_an_answer_written_into_a_stream_is_counted() -> None:
    letters = [{"subject": "chaos.dispatch.v1.t", "consumer": "dispatcher",
                "payload_excerpt": '{"ok":false,"error":{"code":"not_found","message":'
                                   f'"operation \'{REPLY_MARK}-1-0-0\' not found"}}}}'},
               {"subject": "chaos.dispatch.v1.t", "consumer": "dispatcher",
                "payload_excerpt": "garbage"}]
    found = forged_effects(_db(dead_letters=letters), {}, [])
    assert found == [{"what": "ledger answer written into a stream",
                      "subject": "chaos.dispatch.v1.t", "consumer": "dispatcher"}]
