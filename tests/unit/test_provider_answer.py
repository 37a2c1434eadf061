"""The provider's answer kept with a success (issue 13): bounded per tool, scrubbed of the
request's credentials, narrowed by `result_path`; accepted, failed and ambiguous outcomes
carry none."""

from __future__ import annotations

from dataclasses import replace

import pytest

from effectledger_core.catalog import Tool
from effectledger_core.digest import digest
from effectledger_core.messages import AttemptAccepted, AttemptFailed, AttemptSucceeded
from effectledger_core.results import REDACTED, ProviderResult
from effectledger_reconciler.decisions import Decide
from tests.unit.test_provider_call import SECRET, call, make_tool, status
from tests.unit.test_reconciler_strategy import FOUND, NOT_FOUND, run_after
from tests.unit.test_reconciler_strategy import make_tool as reconciler_tool


async def test_a_success_carries_the_providers_json_answer() -> None:
    outcome, _ = await call(make_tool(), status(201, {"id": "tk_9", "url": "https://t/9"}))
    assert isinstance(outcome, AttemptSucceeded)
    assert outcome.result == ProviderResult(kind="json", value={"id": "tk_9",
                                                                "url": "https://t/9"},
                                            bytes=outcome.result.bytes if outcome.result else 0)


async def test_result_path_keeps_only_the_part_named() -> None:
    tool = make_tool(result_path="$.data.ticket")
    outcome, _ = await call(tool, status(200, {"data": {"ticket": {"id": 1}, "noise": "x"}}))
    assert isinstance(outcome, AttemptSucceeded) and outcome.result is not None
    assert outcome.result.value == {"id": 1}


async def test_an_echoed_credential_never_reaches_the_result() -> None:
    outcome, _ = await call(make_tool(), status(200, {"echo": f"Bearer {SECRET}"}))
    assert isinstance(outcome, AttemptSucceeded) and outcome.result is not None
    assert outcome.result.value == {"echo": REDACTED}
    assert SECRET not in outcome.model_dump_json()


async def test_the_tool_bounds_its_result_and_zero_keeps_none() -> None:
    small = make_tool(max_result_bytes=16)
    outcome, _ = await call(small, status(200, "x" * 100, {"content-type": "text/plain"}))
    assert isinstance(outcome, AttemptSucceeded) and outcome.result is not None
    assert outcome.result.truncated and outcome.result.value == "x" * 14
    outcome, _ = await call(make_tool(max_result_bytes=0), status(200, {"id": 1}))
    assert isinstance(outcome, AttemptSucceeded) and outcome.result is None


@pytest.mark.parametrize(("code", "kind"), [(202, AttemptAccepted), (422, AttemptFailed)])
async def test_other_outcomes_carry_no_result(code: int, kind: type) -> None:
    tool = make_tool(capabilities={"async_acceptance": True}) if code == 202 else make_tool()
    outcome, _ = await call(tool, status(code, {"id": "x"}))
    assert isinstance(outcome, kind) and not hasattr(outcome, "result")


def test_a_bad_result_path_fails_the_catalog_naming_the_field() -> None:
    with pytest.raises(ValueError, match="result_path"):
        Tool.model_validate({"name": "t", "endpoint": "https://p/x", "contract_revision": "r",
                             "result_path": "data.id"})


def test_unused_new_fields_leave_an_entrys_digest_unchanged() -> None:
    """An entry that sets none of the later fields digests exactly as before they existed
    (these two, and the identical-call rule's `dedupe_window_s`, `title`, `reversibility`)."""
    plain = make_tool()
    later = ("max_result_bytes", "result_path", "dedupe_window_s", "title", "reversibility")
    before = {k: v for k, v in plain.model_dump(mode="json").items() if k not in later}
    assert plain.digest() == digest(before)
    assert plain.digest() != make_tool(result_path="$.id").digest()


def test_a_readback_that_found_the_effect_hands_its_answer_to_the_verdict() -> None:
    """The readback answers what the lost response would have: `applied` carries it."""
    kept = ProviderResult(kind="json", value={"id": "eff_1"}, bytes=14)
    d = run_after(reconciler_tool(readback=True), replace(FOUND, result=kept), 1.0, 1.2)
    assert isinstance(d, Decide) and d.verdict == "applied" and d.result == kept
    d = run_after(reconciler_tool(readback=True), NOT_FOUND, 1e6)
    assert isinstance(d, Decide) and d.verdict == "not_applied" and d.result is None
