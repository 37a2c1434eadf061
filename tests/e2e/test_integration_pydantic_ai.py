"""pydantic-ai on effectledger (issue 29): `LedgerToolset` driven by pydantic-ai's own test
models (`TestModel`, `FunctionModel`) against a real stack, with the sandbox's ground truth of
what was applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed: pip install -e "
                    "'.[integrations]'")

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel

from effectledger_integrations.pydantic_ai import LedgerToolset
from tests.support import agentstack
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


class Script:
    """A model that makes the given tool calls, one per turn, then ends with a text; it keeps
    every part the agent sent back to it (tool returns, retry prompts)."""

    def __init__(self, *calls: ToolCallPart) -> None:
        self.calls = list(calls)
        self.seen: list[Any] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        if isinstance(last, ModelRequest):
            self.seen += [p for p in last.parts
                          if isinstance(p, ToolReturnPart | RetryPromptPart)]
        if self.calls:
            return ModelResponse(parts=[self.calls.pop(0)])
        return ModelResponse(parts=[TextPart("done")])

    def returns(self) -> list[dict[str, Any]]:
        assert all(isinstance(p, ToolReturnPart) for p in self.seen), self.seen
        return [p.content for p in self.seen]


def _agent(toolset: LedgerToolset, model: Any) -> Agent[None, str]:
    return Agent(model, toolsets=[toolset])


async def test_pydantic_ai_calls_go_through_the_ledger(
        make_cluster: Callable[..., Cluster]) -> None:
    """A call applies one effect; a re-run of the same run (same run_id, same tool-call id, as a
    durable engine replays it) joins the first operation with no second effect, while another
    run's call is its own operation; a lost provider answer reaches the model as a result saying
    do not retry (never an exception or a retry prompt), and the status tool gives the final
    outcome."""
    c = await agentstack.start(make_cluster)
    async with agentstack.client(c) as client:
        toolset = LedgerToolset(client, tools=["create_ticket", "send_email", "fast_page"],
                                wait_s=15)

        # pydantic-ai's TestModel calls the tool with arguments made from its schema.
        before = await agentstack.applied(c)
        run = await _agent(toolset, TestModel(call_tools=["create_ticket"])).run("open one")
        done: list[Any] = [p.content for m in run.all_messages()
                           for p in getattr(m, "parts", [])
                           if isinstance(p, ToolReturnPart) and p.tool_name == "create_ticket"]
        assert len(done) == 1 and done[0]["outcome"] == "succeeded", done
        assert done[0]["replayed"] is False
        assert done[0]["idempotency_key"].startswith("pydantic-ai:")
        assert await agentstack.applied(c) == before + 1

        # The same run executed again (a durable engine's replay): same run_id, same call id.
        email = ToolCallPart("send_email", {"to": "ops@example.com"}, tool_call_id="call-e1")
        first, again = Script(email), Script(email)
        before, ops = await agentstack.applied(c), await agentstack.operations(c)
        await _agent(toolset, FunctionModel(first)).run("mail ops", run_id="run-mail")
        await _agent(toolset, FunctionModel(again)).run("mail ops", run_id="run-mail")
        (one,), (two,) = first.returns(), again.returns()
        assert one["outcome"] == "succeeded" and one["replayed"] is False, one
        assert two["operation_id"] == one["operation_id"] and two["replayed"] is True, two
        assert two["idempotency_key"] == one["idempotency_key"]
        assert await agentstack.applied(c) == before + 1  # the provider does not deduplicate
        assert await agentstack.operations(c) == ops + 1
        # The same call id in another run is another call.
        other = Script(email)
        await _agent(toolset, FunctionModel(other)).run("mail ops", run_id="run-mail-2")
        (three,) = other.returns()
        assert three["operation_id"] != one["operation_id"] and three["replayed"] is False
        assert await agentstack.applied(c) == before + 2

        # The provider applies the page and the answer is lost: unknown, do not retry.
        await agentstack.fault(c, "plainpager", {"kind": "drop_after_apply"})
        before = await agentstack.applied(c)
        page = Script(ToolCallPart("fast_page", {"text": "disk full"}, tool_call_id="call-p1"))
        result = await _agent(toolset, FunctionModel(page)).run("page ops")
        assert result.output == "done"
        (unknown,) = page.returns()  # a tool result, not a retry prompt
        assert unknown["outcome"] == "unknown" and unknown["do_not_retry"] is True, unknown
        assert unknown["state"] in ("ambiguous", "needs_review")
        assert "Do NOT retry" in unknown["message"]
        assert "effectledger_status" in unknown["message"]
        assert await agentstack.applied(c) == before + 1

        # Later, the status tool: the reconciler found no oracle for this tool, so review.
        await c.wait_state(unknown["operation_id"], "needs_review", 30)
        status = Script(ToolCallPart("effectledger_status",
                                     {"operation_id": unknown["operation_id"]},
                                     tool_call_id="call-s1"))
        await _agent(toolset, FunctionModel(status)).run("what happened?")
        (final,) = status.returns()
        assert final["state"] == "needs_review" and final["do_not_retry"] is True, final
        assert final["idempotency_key"] == unknown["idempotency_key"]
        assert await agentstack.applied(c) == before + 1
