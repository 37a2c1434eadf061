"""LangGraph on effectledger (issue 29): `ledger_tools` in LangGraph's prebuilt `ToolNode`,
driven by LangChain's `GenericFakeChatModel` in a checkpointed graph against a real stack, with
the sandbox's ground truth of what was applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("langgraph", reason="langgraph is not installed: pip install -e "
                    "'.[integrations]'")

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from effectledger_integrations.langgraph import ledger_tools
from tests.support import agentstack
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def _graph(tools: list[Any], *replies: AIMessage) -> Any:
    """agent → tools → agent …, the model a fake that says `replies` in turn."""
    model = GenericFakeChatModel(messages=iter(replies))

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode(tools))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=InMemorySaver())


def _call(call_id: str, name: str, args: dict[str, Any]) -> AIMessage:
    return AIMessage("", tool_calls=[{"id": call_id, "name": name, "args": args,
                                      "type": "tool_call"}])


def _results(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The answers the tools gave, as the model's next turn saw them (the artifact is the
    content's JSON as a dict)."""
    out = []
    for m in state["messages"]:
        if isinstance(m, ToolMessage):
            assert m.status == "success", m
            out.append(m.artifact)
    return out


def _thread(name: str) -> RunnableConfig:
    return {"configurable": {"thread_id": name}}


async def test_langgraph_tool_node_calls_go_through_the_ledger(
        make_cluster: Callable[..., Cluster]) -> None:
    """A tool call applies one effect; replaying the graph from the checkpoint before its tool
    node (LangGraph re-runs the same message's call, same id, same thread) joins the first
    operation with no second effect, while the same id in another thread is its own; a lost
    provider answer is a successful ToolMessage saying do not retry, and the status tool gives
    the final outcome."""
    c = await agentstack.start(make_cluster)
    async with agentstack.client(c) as client:
        tools = await ledger_tools(client, tools=["create_ticket", "send_email", "fast_page"],
                                   wait_s=15)

        before = await agentstack.applied(c)
        graph = _graph(tools, _call("call-t1", "create_ticket", {"title": "from langgraph"}),
                       AIMessage("done"))
        state = await graph.ainvoke({"messages": [("user", "open one")]}, _thread("t-ticket"))
        (done,) = _results(state)
        assert done["outcome"] == "succeeded" and done["replayed"] is False, done
        assert done["idempotency_key"].startswith("langgraph:")
        assert await agentstack.applied(c) == before + 1

        # Replay from the checkpoint before the tool node: the same call runs again.
        email = _call("call-e1", "send_email", {"to": "ops@example.com"})
        before, ops = await agentstack.applied(c), await agentstack.operations(c)
        graph = _graph(tools, email, AIMessage("done"), AIMessage("done again"))
        config = _thread("t-mail")
        state = await graph.ainvoke({"messages": [("user", "mail ops")]}, config)
        (one,) = _results(state)
        assert one["outcome"] == "succeeded" and one["replayed"] is False, one
        history = [s async for s in graph.aget_state_history(config)]
        (at_tools,) = [s for s in history if s.next == ("tools",)]
        replayed = await graph.ainvoke(None, at_tools.config)
        (two,) = _results(replayed)
        assert two["operation_id"] == one["operation_id"] and two["replayed"] is True, two
        assert await agentstack.applied(c) == before + 1  # the provider does not deduplicate
        assert await agentstack.operations(c) == ops + 1
        other = _graph(tools, email, AIMessage("done"))
        (three,) = _results(await other.ainvoke({"messages": [("user", "mail ops")]},
                                                _thread("t-mail-2")))
        assert three["operation_id"] != one["operation_id"]
        assert await agentstack.applied(c) == before + 2

        # The provider applies the page and its answer is lost: unknown, do not retry.
        await agentstack.fault(c, "plainpager", {"kind": "drop_after_apply"})
        before = await agentstack.applied(c)
        graph = _graph(tools, _call("call-p1", "fast_page", {"text": "disk full"}),
                       AIMessage("done"))
        (unknown,) = _results(await graph.ainvoke({"messages": [("user", "page")]},
                                                  _thread("t-page")))
        assert unknown["outcome"] == "unknown" and unknown["do_not_retry"] is True, unknown
        assert "Do NOT retry" in unknown["message"]
        assert await agentstack.applied(c) == before + 1

        await c.wait_state(unknown["operation_id"], "needs_review", 30)
        graph = _graph(tools, _call("call-s1", "effectledger_status",
                                    {"operation_id": unknown["operation_id"]}),
                       AIMessage("done"))
        (final,) = _results(await graph.ainvoke({"messages": [("user", "status?")]},
                                                _thread("t-status")))
        assert final["state"] == "needs_review" and final["do_not_retry"] is True, final
        assert await agentstack.applied(c) == before + 1
