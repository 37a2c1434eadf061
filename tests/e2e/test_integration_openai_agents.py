"""OpenAI Agents SDK on effectledger (issue 29): `ledger_function_tools` run by the SDK's own
`Runner` with a scripted model (the SDK's `Model` interface, no network) against a real stack,
with the sandbox's ground truth of what was applied."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

pytest.importorskip("agents", reason="openai-agents is not installed: pip install -e "
                    "'.[integrations]'")

from agents import Agent, ModelResponse, RunConfig, Runner, Usage
from agents.models.interface import Model
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from effectledger_integrations.openai_agents import ledger_function_tools
from tests.support import agentstack
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


class ScriptedModel(Model):
    """Makes the given function calls, one per turn, then answers "done"; keeps every
    `function_call_output` the runner sent back to it."""

    def __init__(self, *calls: tuple[str, str, dict[str, Any]]) -> None:
        self.calls = list(calls)
        self.outputs: list[dict[str, Any]] = []

    async def get_response(self, system_instructions: str | None,
                           input: str | list[Any], *args: Any, **kwargs: Any) -> ModelResponse:
        for item in input if isinstance(input, list) else []:
            if isinstance(item, dict) and item.get("type") == "function_call_output":
                self.outputs.append(json.loads(item["output"]))
        if self.calls:
            call_id, name, arguments = self.calls.pop(0)
            out: Any = ResponseFunctionToolCall(
                type="function_call", id=f"fc-{call_id}", call_id=call_id, name=name,
                arguments=json.dumps(arguments), status="completed")
        else:
            out = ResponseOutputMessage(
                type="message", id="msg-done", role="assistant", status="completed",
                content=[ResponseOutputText(type="output_text", text="done",
                                            annotations=[])])
        return ModelResponse(output=[out], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the tests run the agent without streaming")


async def _run(tools: list[Any], model: ScriptedModel, group: str | None = None) -> None:
    agent = Agent(name="ops", instructions="Use the tools.", tools=tools, model=model)
    result = await Runner.run(agent, "go", run_config=RunConfig(
        tracing_disabled=True, group_id=group))
    assert result.final_output == "done"


async def test_openai_agents_calls_go_through_the_ledger(
        make_cluster: Callable[..., Cluster]) -> None:
    """A function call applies one effect; the same call (same call id, same conversation
    group) run again joins the first operation with no second effect, while the same call id in
    another conversation is its own; a lost provider answer reaches the model as a
    function-call output saying do not retry, and the status tool gives the final outcome."""
    c = await agentstack.start(make_cluster)
    async with agentstack.client(c) as client:
        tools = await ledger_function_tools(
            client, tools=["create_ticket", "send_email", "fast_page", "charge_card"],
            wait_s=15)
        assert {t.name for t in tools} == {"create_ticket", "send_email", "fast_page",
                                           "charge_card", "effectledger_status"}

        before = await agentstack.applied(c)
        model = ScriptedModel(("call-t1", "create_ticket", {"title": "from agents"}))
        await _run(tools, model)
        (done,) = model.outputs
        assert done["outcome"] == "succeeded" and done["replayed"] is False, done
        assert done["result"]["body"] == {"title": "from agents"}  # the provider's own answer
        assert done["idempotency_key"].startswith("openai-agents:")
        assert await agentstack.applied(c) == before + 1

        # The same call again in the same conversation: the first operation, one effect.
        email = ("call-e1", "send_email", {"to": "ops@example.com"})
        first, again = ScriptedModel(email), ScriptedModel(email)
        before, ops = await agentstack.applied(c), await agentstack.operations(c)
        await _run(tools, first, group="conv-1")
        await _run(tools, again, group="conv-1")
        (one,), (two,) = first.outputs, again.outputs
        assert one["outcome"] == "succeeded" and one["replayed"] is False, one
        assert two["operation_id"] == one["operation_id"] and two["replayed"] is True, two
        assert await agentstack.applied(c) == before + 1  # the provider does not deduplicate
        assert await agentstack.operations(c) == ops + 1
        other = ScriptedModel(email)
        await _run(tools, other, group="conv-2")
        assert other.outputs[0]["operation_id"] != one["operation_id"]
        assert await agentstack.applied(c) == before + 2

        # Arguments the catalog's schema refuses: a result naming the field, nothing sent.
        ops = await agentstack.operations(c)
        bad = ScriptedModel(("call-b1", "charge_card", {"amount": 5}))
        await _run(tools, bad)
        (refused,) = bad.outputs
        assert refused["outcome"] == "refused" and refused["do_not_retry"] is False, refused
        assert "currency" in json.dumps(refused)
        assert await agentstack.operations(c) == ops

        # The provider applies the page and its answer is lost: unknown, do not retry.
        await agentstack.fault(c, "plainpager", {"kind": "drop_after_apply"})
        before = await agentstack.applied(c)
        page = ScriptedModel(("call-p1", "fast_page", {"text": "disk full"}))
        await _run(tools, page)
        (unknown,) = page.outputs
        assert unknown["outcome"] == "unknown" and unknown["do_not_retry"] is True, unknown
        assert "Do NOT retry" in unknown["message"]
        assert await agentstack.applied(c) == before + 1

        await c.wait_state(unknown["operation_id"], "needs_review", 30)
        status = ScriptedModel(("call-s1", "effectledger_status",
                                {"operation_id": unknown["operation_id"]}))
        await _run(tools, status)
        (final,) = status.outputs
        assert final["state"] == "needs_review" and final["do_not_retry"] is True, final
        assert await agentstack.applied(c) == before + 1
