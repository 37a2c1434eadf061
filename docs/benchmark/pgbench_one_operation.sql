-- effectledger: the SQL of one operation, captured from the ledger's own statements
-- (log_statement=all); per-operation identifiers are unique per pgbench transaction.
\set n random(1, 9000000000000000000)
-- transaction at 2026-11-30 04:07:39.009 UTC on backend 26589
BEGIN;
ROLLBACK;
BEGIN;
SELECT operations.id, operations.tenant, operations.task_id, operations.caller_key, operations.operation_key, operations.tool, operations.arguments, operations.arguments_digest, operations.tool_digest, operations.contract_revision, operations.effect_class, operations.commit_policy, operations.state, operations.epoch, operations.created_at, operations.updated_at, operations.provider_ref, operations.response_digest, operations.last_outcome, operations.evidence 
FROM operations 
WHERE operations.operation_key = 'b1-:client_id-:n'::VARCHAR;
INSERT INTO operations (id, tenant, task_id, caller_key, operation_key, tool, arguments, arguments_digest, tool_digest, contract_revision, effect_class, commit_policy, state, epoch, created_at, updated_at) VALUES ('b4-:client_id-:n'::VARCHAR, 'default'::VARCHAR, 'capture-2'::VARCHAR, 'cap-:client_id-:n'::VARCHAR, 'b1-:client_id-:n'::VARCHAR, 'create_ticket'::VARCHAR, '{"title": "capture-2 #0"}'::JSONB, 'sha256:acf378dd3bef2266086042501419c1ae46246e5dd254a0c65929f2479faa300b'::VARCHAR, 'sha256:6498924ac89389d0a040503b9d16ab347b749628b52b0df56a2fd384b5202ea0'::VARCHAR, 'bench-1'::VARCHAR, 'idempotent'::VARCHAR, 'auto'::VARCHAR, 'pending'::VARCHAR, '1'::INTEGER, '2026-11-30 04:07:39.00684+00'::TIMESTAMP WITH TIME ZONE, '2026-11-30 04:07:39.00684+00'::TIMESTAMP WITH TIME ZONE);
INSERT INTO journal (operation_id, at, kind, epoch, from_state, to_state, actor, detail) VALUES ('b4-:client_id-:n'::VARCHAR, '2026-11-30 04:07:39.00684+00'::TIMESTAMP WITH TIME ZONE, 'intent_accepted'::VARCHAR, '1'::INTEGER, NULL::VARCHAR, 'pending'::VARCHAR, 'agent:nats'::VARCHAR, '{"tenant": "default", "task_id": "capture-2", "tool_digest": "sha256:6498924ac89389d0a040503b9d16ab347b749628b52b0df56a2fd384b5202ea0", "arguments_digest": "sha256:acf378dd3bef2266086042501419c1ae46246e5dd254a0c65929f2479faa300b", "contract_revision": "bench-1"}'::JSONB) RETURNING journal.id;
INSERT INTO outbox (id, operation_id, epoch, kind, subject, payload, status, created_at, available_at, publish_count) VALUES ('b3-:client_id-:n'::VARCHAR, 'b4-:client_id-:n'::VARCHAR, '1'::INTEGER, 'dispatch'::VARCHAR, 'bencha8b1e6.dispatch.v1.create_ticket'::VARCHAR, '{"schema_version":1,"type":"dispatch_attempt","operation_id":"b4-:client_id-:n","operation_key":"b1-:client_id-:n","epoch":1,"tool":"create_ticket","arguments":{"title":"capture-2 #0"},"arguments_digest":"sha256:acf378dd3bef2266086042501419c1ae46246e5dd254a0c65929f2479faa300b","catalog_digest":"sha256:6498924ac89389d0a040503b9d16ab347b749628b52b0df56a2fd384b5202ea0","contract_revision":"bench-1"}'::VARCHAR, 'pending'::VARCHAR, '2026-11-30 04:07:39.00684+00'::TIMESTAMP WITH TIME ZONE, '2026-11-30 04:07:39.00684+00'::TIMESTAMP WITH TIME ZONE, '0'::INTEGER);
SELECT pg_notify('effectledger_outbox', '');
COMMIT;
-- transaction at 2026-11-30 04:07:39.018 UTC on backend 26587
BEGIN;
ROLLBACK;
BEGIN;
SELECT outbox.id, outbox.subject, outbox.payload, outbox.publish_count, outbox.kind 
FROM outbox 
WHERE (outbox.status = 'pending'::VARCHAR OR outbox.status = 'publishing'::VARCHAR AND outbox.lease_until < '2026-11-30 04:07:39.01713+00'::TIMESTAMP WITH TIME ZONE) AND outbox.available_at <= '2026-11-30 04:07:39.01713+00'::TIMESTAMP WITH TIME ZONE ORDER BY outbox.available_at 
 LIMIT '256'::INTEGER FOR UPDATE SKIP LOCKED;
UPDATE outbox SET status='publishing'::VARCHAR, lease_until='2026-11-30 04:08:09.01713+00'::TIMESTAMP WITH TIME ZONE WHERE outbox.id IN ('b3-:client_id-:n'::VARCHAR);
COMMIT;
-- transaction at 2026-11-30 04:07:39.032 UTC on backend 26588
BEGIN;
ROLLBACK;
BEGIN;
UPDATE outbox SET status='published'::VARCHAR, lease_until=NULL::TIMESTAMP WITH TIME ZONE, published_at='2026-11-30 04:07:39.029927+00'::TIMESTAMP WITH TIME ZONE WHERE outbox.id IN ('b3-:client_id-:n'::VARCHAR) AND outbox.status = 'publishing'::VARCHAR;
COMMIT;
-- transaction at 2026-11-30 04:07:39.035 UTC on backend 26589
BEGIN;
ROLLBACK;
BEGIN;
SELECT operations.state, operations.epoch 
FROM operations 
WHERE operations.id = 'b4-:client_id-:n'::VARCHAR;
SELECT attempts.id, attempts.status 
FROM attempts 
WHERE attempts.operation_id = 'b4-:client_id-:n'::VARCHAR AND attempts.epoch = '1'::INTEGER;
UPDATE operations SET state='in_flight'::VARCHAR, updated_at='2026-11-30 04:07:39.034181+00'::TIMESTAMP WITH TIME ZONE WHERE operations.id = 'b4-:client_id-:n'::VARCHAR AND operations.epoch = '1'::INTEGER AND operations.state IN ('pending'::VARCHAR);
INSERT INTO attempts (id, operation_id, epoch, dispatcher_id, status, claimed_at) VALUES ('b2-:client_id-:n'::VARCHAR, 'b4-:client_id-:n'::VARCHAR, '1'::INTEGER, 'dispatcher-1'::VARCHAR, 'claimed'::VARCHAR, '2026-11-30 04:07:39.034181+00'::TIMESTAMP WITH TIME ZONE);
UPDATE outbox SET status='consumed'::VARCHAR WHERE outbox.operation_id = 'b4-:client_id-:n'::VARCHAR AND outbox.epoch = '1'::INTEGER AND outbox.kind = 'dispatch'::VARCHAR;
INSERT INTO journal (operation_id, at, kind, epoch, from_state, to_state, actor, detail) VALUES ('b4-:client_id-:n'::VARCHAR, '2026-11-30 04:07:39.034181+00'::TIMESTAMP WITH TIME ZONE, 'attempt_claimed'::VARCHAR, '1'::INTEGER, 'pending'::VARCHAR, 'in_flight'::VARCHAR, 'dispatcher-1'::VARCHAR, '{"attempt_id": "b2-:client_id-:n"}'::JSONB) RETURNING journal.id;
COMMIT;
-- transaction at 2026-11-30 04:07:39.057 UTC on backend 26587
BEGIN;
ROLLBACK;
BEGIN;
INSERT INTO inbox (consumer, message_id, received_at) VALUES ('ledger-inbox'::VARCHAR, 'attempt_succeeded:b2-:client_id-:n'::VARCHAR, '2026-11-30 04:07:39.052439+00'::TIMESTAMP WITH TIME ZONE) ON CONFLICT DO NOTHING;
SELECT operations.id, operations.tenant, operations.task_id, operations.caller_key, operations.operation_key, operations.tool, operations.arguments, operations.arguments_digest, operations.tool_digest, operations.contract_revision, operations.effect_class, operations.commit_policy, operations.state, operations.epoch, operations.created_at, operations.updated_at, operations.provider_ref, operations.response_digest, operations.last_outcome, operations.evidence 
FROM operations 
WHERE operations.id = 'b4-:client_id-:n'::VARCHAR FOR UPDATE;
SELECT attempts.id 
FROM attempts 
WHERE attempts.operation_id = 'b4-:client_id-:n'::VARCHAR AND attempts.epoch = '1'::INTEGER;
UPDATE operations SET state='succeeded'::VARCHAR, updated_at='2026-11-30 04:07:39.052439+00'::TIMESTAMP WITH TIME ZONE, provider_ref='eff_1'::VARCHAR, response_digest='sha256:47606e0c643a0aa186eb16fdcf7b13fdffb783ad9e5ffd0e71ffc60de7453cf5'::VARCHAR, last_outcome='{"at": "2026-11-30T04:07:39.049818Z", "type": "attempt_succeeded", "epoch": 1, "attempt_id": "b2-:client_id-:n", "duration_ms": 5.606816999716102, "http_status": 201, "operation_id": "b4-:client_id-:n", "provider_ref": "eff_1", "dispatcher_id": "dispatcher-1", "schema_version": 1, "response_digest": "sha256:47606e0c643a0aa186eb16fdcf7b13fdffb783ad9e5ffd0e71ffc60de7453cf5"}'::JSONB WHERE operations.id = 'b4-:client_id-:n'::VARCHAR AND operations.epoch = '1'::INTEGER AND operations.state = 'in_flight'::VARCHAR;
UPDATE attempts SET status='attempt_succeeded'::VARCHAR, finished_at='2026-11-30 04:07:39.052439+00'::TIMESTAMP WITH TIME ZONE, http_status='201'::INTEGER, provider_ref='eff_1'::VARCHAR, response_digest='sha256:47606e0c643a0aa186eb16fdcf7b13fdffb783ad9e5ffd0e71ffc60de7453cf5'::VARCHAR, outcome='{"at": "2026-11-30T04:07:39.049818Z", "type": "attempt_succeeded", "epoch": 1, "attempt_id": "b2-:client_id-:n", "duration_ms": 5.606816999716102, "http_status": 201, "operation_id": "b4-:client_id-:n", "provider_ref": "eff_1", "dispatcher_id": "dispatcher-1", "schema_version": 1, "response_digest": "sha256:47606e0c643a0aa186eb16fdcf7b13fdffb783ad9e5ffd0e71ffc60de7453cf5"}'::JSONB WHERE attempts.id = 'b2-:client_id-:n'::VARCHAR;
INSERT INTO journal (operation_id, at, kind, epoch, from_state, to_state, actor, detail) VALUES ('b4-:client_id-:n'::VARCHAR, '2026-11-30 04:07:39.052439+00'::TIMESTAMP WITH TIME ZONE, 'outcome_recorded'::VARCHAR, '1'::INTEGER, 'in_flight'::VARCHAR, 'succeeded'::VARCHAR, 'dispatcher-1'::VARCHAR, '{"at": "2026-11-30T04:07:39.049818Z", "type": "attempt_succeeded", "epoch": 1, "attempt_id": "b2-:client_id-:n", "duration_ms": 5.606816999716102, "http_status": 201, "operation_id": "b4-:client_id-:n", "provider_ref": "eff_1", "dispatcher_id": "dispatcher-1", "schema_version": 1, "response_digest": "sha256:47606e0c643a0aa186eb16fdcf7b13fdffb783ad9e5ffd0e71ffc60de7453cf5"}'::JSONB) RETURNING journal.id;
COMMIT;
