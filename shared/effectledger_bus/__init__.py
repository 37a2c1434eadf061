"""The messaging edge every service uses; no service talks to NATS any other way.

- `connect`: connections from settings; `streams`: stream definitions;
- `pull`: JetStream pull consumers; `delivery`: one delivery (ack, nak, term, heartbeat) and
  dead-letter records; `backoff`: the one nak delay rule;
- `publish`: publish with publish-ack, and retries; `msgids`: every `Nats-Msg-Id`;
- `rpc`: request-reply, serving and asking, with typed replies;
- `asyncapi`: the message contract document; `testing`: in-memory fakes for unit tests.
"""
