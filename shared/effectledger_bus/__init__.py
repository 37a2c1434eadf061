"""The messaging edge every service uses; no service talks to NATS any other way.

- `connect`: connections from settings; `streams`: stream definitions;
- `pull`: JetStream pull consumers; `delivery`: one delivery (ack, nak, term, heartbeat) and
  dead-letter records; `backoff`: the one nak delay rule;
- `catalogue`: every message with its subject, `Nats-Msg-Id`, publisher and consumers, from
  which the contract document, the permissions and the streams' subjects are derived;
- `publish`: publish with publish-ack, and retries;
- `rpc`: request-reply, serving and asking, with typed replies;
- `asyncapi`: the message contract document; `testing`: in-memory fakes for unit tests.

Consumers and request-reply run on nats-py directly, not through FastStream, for measured
reasons given in `pull` (a fetch that waits for its batch: p50 81 ms at half rate; the
subscriber stack: about half the dispatcher's CPU) and `rpc` (a quarter of the ledger's CPU).
The three services consume one way: `PullConsumer` handing each message to a handler that
takes a `Delivery`.
"""
