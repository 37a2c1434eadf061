"""The reconciler's webhook endpoint counts deliveries by configured provider and reason."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_webhooks_ingest import URL, FakePublisher, event, make_app, signed


def scraped(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {frozenset(s.labels.items()): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


async def test_webhooks_are_counted_received_verified_refused_with_bounded_labels() -> None:
    app = make_app(FakePublisher())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://r") as client:
        before = (await client.get("/metrics")).text
        body = event()
        assert (await client.post(URL, content=body, headers=signed(body))).status_code == 200
        forged = {**signed(body, webhook_id="msg_2"), "webhook-signature": "v1,AAAA"}
        assert (await client.post(URL, content=body, headers=forged)).status_code == 401
        assert (await client.post("/v1/webhooks/attacker-text-9f8e", content=body,
                                  headers=signed(body))).status_code == 404
        after = (await client.get("/metrics")).text

    def delta(name: str, **labels: str) -> float:
        key = frozenset(labels.items())
        return scraped(after, name).get(key, 0.0) - scraped(before, name).get(key, 0.0)

    assert delta("effectledger_webhooks_received_total", provider="sandbox") == 2
    assert delta("effectledger_webhooks_received_total", provider="other") == 1
    assert delta("effectledger_webhooks_verified_total", provider="sandbox") == 1
    assert delta("effectledger_webhooks_refused_total", provider="sandbox",
                 reason="invalid_signature") == 1
    assert delta("effectledger_webhooks_refused_total", provider="other",
                 reason="unknown_provider") == 1
    assert "attacker-text-9f8e" not in after
    assert 'route="/v1/webhooks/{provider}"' in after
