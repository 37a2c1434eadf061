"""The checker: the ten invariants of issue 5, from recorded histories and final state. Pure.

Inputs are what the run recorded (the callers' history, the executed faults) and what it read
at the end (the ledger's rows and journal, the provider's ground truth and request log, the
broker's streams, the logs). Each invariant is a count that must be zero, with a few examples
so a violation can be followed up:

1. duplicate effects: more than one applied effect for an operation key (non-idempotent or
   idempotent alike: one decision, one effect);
2. lost intents: an intent acknowledged to a caller that is missing, is another operation, or
   never came to rest;
3. operations not at rest after the quiet period;
4. verdicts that contradict the provider: `succeeded` without the effect, `failed` or
   `cancelled` with it, a `not_applied` verdict for an epoch whose request did apply (also when
   the effect appeared later);
5. more than one provider request for one operation epoch (key + fencing token);
6. stale-epoch writes accepted: a journaled state change for an epoch other than the current
   one, an outcome from an attempt that did not hold the epoch's claim, a ledger state that its
   journal does not explain, or a provider effect applied under a lower fencing token than one
   it had already seen;
7. reviews that were not needed: a type (a) operation (idempotent, with readback) in review;
8. state changes caused by bad webhooks: a forged, expired or otherwise invalid webhook that
   got a 2xx, was stored as evidence, or moved an operation;
9. leftover backlog: outbox rows still to publish or to answer, messages left in the streams,
   and services whose memory kept growing;
10. planted canary secrets found in any log, message or row;
11. forged messages that moved an operation or reached a provider: the attacker's forgeries
   (attacker.py) each carry the `forged` mark in a field the ledger or the provider keeps, so
   any state change by a forged sender, granted forged claim, stored forged webhook not marked
   refused, operation in the forged tenant, provider request under a forged key, or ledger
   answer written into a stream (a dead letter naming the reply attack's made-up operation)
   is counted.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from . import metrics
from .availability import availability
from .config import TOOL_TYPE_OF, ChaosConfig
from .procs import Service
from .schedule import Schedule
from .stack import ExitRecord

AT_REST = frozenset({"succeeded", "failed", "cancelled", "needs_review"})
INVARIANTS = (
    "duplicate_effects", "lost_intents", "not_at_rest", "verdicts_contradicting_truth",
    "duplicate_requests_per_epoch", "stale_epoch_writes_accepted", "unneeded_reviews",
    "bad_webhook_state_changes", "leftover_backlog", "canary_leaks", "forged_messages_effective",
)
FORGED = "forged"  # the mark every forgery of the attacker carries
# The made-up operation the reply-subject attack reads: the ledger's answer names it, so an
# answer written into a stream is a dead letter carrying it.
REPLY_MARK = f"{FORGED}-reply"
RETRY_SOURCES = frozenset({"in_flight", "ambiguous", "awaiting_confirmation", "needs_review",
                           "failed"})
EXAMPLES = 8


def _applied(outcome: str) -> bool:
    return outcome.startswith("applied") or outcome == "late_apply:applied"


def _inv(items: list[Any], count: int | None = None) -> dict[str, Any]:
    return {"count": len(items) if count is None else count, "examples": items[:EXAMPLES]}


def check(*, cfg: ChaosConfig, schedule: Schedule, history: list[dict[str, Any]],
          data: dict[str, Any], fault_records: list[dict[str, Any]],
          sandbox_faults: dict[str, Any], bad_webhooks: list[dict[str, Any]],
          bad_input: dict[str, Any], exits: list[ExitRecord], services: dict[str, Service],
          canary_hits: list[dict[str, Any]], phase_start_wall: float) -> dict[str, Any]:
    db = data["db"]
    ops = db["operations"]
    by_key = {o["caller_key"]: o for o in ops if o["caller_key"] is not None}
    journal: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in db["journal"]:
        if e["operation_id"] is not None:
            journal[e["operation_id"]].append(e)
    truth = data["sandbox"]["truth"]["keys"]
    requests = data["sandbox"]["requests"]
    req_by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in requests:
        if r["key"] is not None:
            req_by_key[r["key"]].append(r)

    inv: dict[str, dict[str, Any]] = {}

    # 1. duplicate effects
    dups = [{"operation_key": k, "applied": t["applied"], "requests": t["requests"],
             "routes": t["routes"]} for k, t in truth.items() if t["applied"] > 1]
    inv["duplicate_effects"] = _inv(dups)

    # 2. lost intents
    acked: dict[int, set[str]] = defaultdict(set)
    first_invoke: dict[int, float] = {}
    for h in history:
        if h["f"] != "submit":
            continue
        if h["type"] == "invoke":
            first_invoke.setdefault(h["op"], h["wall"])
        elif h["type"] == "ok":
            acked[h["op"]].add(h["operation_id"])
    plan = {o.index: o for o in schedule.ops}
    lost = []
    for index, ids in sorted(acked.items()):
        op = by_key.get(plan[index].caller_key)
        if op is None:
            lost.append({"op": index, "why": "acknowledged but not in the ledger"})
        elif ids != {op["id"]}:
            lost.append({"op": index, "why": "acknowledged as another operation",
                         "acked": sorted(ids), "ledger": op["id"]})
        elif op["state"] not in AT_REST:
            lost.append({"op": index, "why": f"never came to rest ({op['state']})",
                         "operation_id": op["id"]})
    inv["lost_intents"] = _inv(lost)

    # 3. not at rest
    restless = [{"operation_id": o["id"], "tool": o["tool"], "state": o["state"],
                 "epoch": o["epoch"]} for o in ops if o["state"] not in AT_REST]
    inv["not_at_rest"] = _inv(restless)

    # 4. verdicts that contradict the provider's truth
    contra = []
    for o in ops:
        applied = truth.get(o["operation_key"], {}).get("applied", 0)
        if o["state"] == "succeeded" and applied == 0:
            contra.append({"operation_id": o["id"], "tool": o["tool"],
                           "why": "succeeded, but the provider never applied it",
                           "evidence": o.get("evidence")})
        if o["state"] in ("failed", "cancelled") and applied > 0:
            contra.append({"operation_id": o["id"], "tool": o["tool"],
                           "why": f"{o['state']}, but the provider applied it",
                           "evidence": o.get("evidence")})
        for e in journal[o["id"]]:
            if e["kind"] != "verdict_not_applied":
                continue
            hits = [r for r in req_by_key.get(o["operation_key"], [])
                    if r["fencing_token"] == e["epoch"] and _applied(r["outcome"])]
            if hits:
                contra.append({"operation_id": o["id"], "tool": o["tool"], "epoch": e["epoch"],
                               "why": "not_applied verdict, but that epoch's request applied",
                               "evidence": (e["detail"] or {}).get("evidence")})
    inv["verdicts_contradicting_truth"] = _inv(contra)

    # 5. more than one provider request per operation epoch
    per_epoch = Counter((r["key"], r["fencing_token"]) for r in requests if r["key"] is not None)
    multi = [{"operation_key": k, "fencing_token": t, "requests": n}
             for (k, t), n in per_epoch.items() if n > 1]
    inv["duplicate_requests_per_epoch"] = _inv(multi)

    # 6. stale-epoch writes accepted
    inv["stale_epoch_writes_accepted"] = _inv(_stale_writes(ops, journal, db["attempts"],
                                                            req_by_key))

    # 7. reviews that were not needed
    unneeded = [{"operation_id": o["id"], "tool": o["tool"], "evidence": o.get("evidence")}
                for o in ops if TOOL_TYPE_OF.get(o["tool"]) == "a"
                and o["state"] == "needs_review"]
    inv["unneeded_reviews"] = _inv(unneeded)

    # 8. bad webhooks
    inv["bad_webhook_state_changes"] = _inv(_bad_webhooks(bad_webhooks, bad_input, db,
                                                          journal))

    # 9. leftover backlog and memory growth
    inv["leftover_backlog"] = _inv(_backlog(db, data.get("jetstream", {}), services))

    # 10. canaries
    inv["canary_leaks"] = _inv(canary_hits)

    # 11. forged messages that moved an operation or reached a provider
    inv["forged_messages_effective"] = _inv(forged_effects(db, truth, requests))

    measured = metrics.metrics(cfg, schedule, ops, journal, first_invoke, acked, by_key,
                               fault_records, phase_start_wall)
    measured["availability"] = availability(history, fault_records, phase_start_wall)
    return {
        "invariants": {name: inv[name] for name in INVARIANTS},
        "ok": all(inv[name]["count"] == 0 for name in INVARIANTS),
        "metrics": measured,
        "faults_injected": metrics.injected(schedule, fault_records, sandbox_faults,
                                            bad_webhooks, bad_input, truth),
        "bad_input": _bad_input_checks(cfg, bad_input, db, fault_records),
        "process_exits": metrics.exits(exits, fault_records, phase_start_wall),
        "memory": _memory(services),
        "fencing": metrics.fencing(db["journal"], requests),
        "operations": _op_outcomes(schedule, by_key, truth),
        "fault_log": fault_records,
        "bad_webhooks": bad_webhooks,
        "history_lines": len(history),
    }


def _op_outcomes(schedule: Schedule, by_key: dict[str, dict[str, Any]],
                 truth: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per planned operation: where it ended, and why if it went to review."""
    out = []
    for op in schedule.ops:
        row = by_key.get(op.caller_key)
        t = truth.get(op.operation_key, {})
        item: dict[str, Any] = {"op": op.index, "type": op.type, "faults": op.fault_kinds,
                                "state": row["state"] if row else None,
                                "epoch": row["epoch"] if row else None,
                                "applied": t.get("applied", 0), "requests": t.get("requests", 0)}
        if row is not None:
            item["operation_id"] = row["id"]
            if row["state"] == "needs_review":
                item["review_reason"] = ((row.get("evidence") or {}).get("reason")
                                         if isinstance(row.get("evidence"), dict) else None)
        out.append(item)
    return out


def _stale_writes(ops: list[dict[str, Any]], journal: dict[str, list[dict[str, Any]]],
                  attempts: list[dict[str, Any]],
                  req_by_key: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    claimed = {(a["operation_id"], a["epoch"]): a["id"] for a in attempts}
    for o in ops:
        state, epoch = None, 1
        for e in journal[o["id"]]:
            if e["kind"] == "intent_accepted":
                state, epoch = e["to_state"], 1
                continue
            if e["to_state"] is None:
                continue
            if e["epoch"] != epoch or (e["from_state"] is not None
                                       and e["from_state"] != state):
                out.append({"operation_id": o["id"], "entry": e["id"], "kind": e["kind"],
                            "entry_epoch": e["epoch"], "current_epoch": epoch,
                            "from_state": e["from_state"], "current_state": state})
            if e["kind"] == "outcome_recorded":
                attempt = (e["detail"] or {}).get("attempt_id")
                if attempt != claimed.get((o["id"], e["epoch"])):
                    out.append({"operation_id": o["id"], "entry": e["id"],
                                "why": "outcome from an attempt that did not hold the claim",
                                "attempt_id": attempt})
            if e["to_state"] == "pending" and (e["from_state"] or state) in RETRY_SOURCES:
                epoch += 1
            state = e["to_state"]
        if state != o["state"] or epoch != o["epoch"]:
            out.append({"operation_id": o["id"], "why": "the journal does not explain the row",
                        "journal_state": state, "journal_epoch": epoch,
                        "row_state": o["state"], "row_epoch": o["epoch"]})
    # At the provider: an effect applied under a token lower than one already seen for the key.
    for key, reqs in req_by_key.items():
        highest = None
        for r in sorted(reqs, key=lambda r: r["seq"]):
            token = r["fencing_token"]
            if token is not None and _applied(r["outcome"]) and highest is not None \
                    and token < highest:
                out.append({"operation_key": key, "why": "provider applied a stale token",
                            "token": token, "highest_seen": highest})
            if token is not None:
                highest = token if highest is None else max(highest, token)
    return out


def _bad_webhooks(sent: list[dict[str, Any]], bad_input: dict[str, Any], db: dict[str, Any],
                  journal: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    stored = {w["webhook_id"]: w for w in db["webhook_events"]}
    moved_by = {}
    for entries in journal.values():
        for e in entries:
            ev = ((e["detail"] or {}).get("evidence") or {})
            if e["kind"] in ("verdict_applied", "verdict_not_applied") and ev.get("webhook_id"):
                moved_by[ev["webhook_id"]] = e["operation_id"]
    out = []
    for b in sent:
        wid = b["webhook_id"]
        status = b.get("status")
        reasons = []
        if status is not None and 200 <= status < 300:
            reasons.append(f"answered {status}")
        if wid in stored:
            reasons.append(f"stored as evidence ({stored[wid]['applied'] or 'kept'})")
        if wid in moved_by:
            reasons.append(f"moved operation {moved_by[wid]}")
        if reasons:
            out.append({"webhook_id": wid, "mode": b["mode"], "lie": b["lie"],
                        "op": b["op"], "what": reasons})
    for w in bad_input.get("webhooks", []) if bad_input.get("ran") else []:
        status = w.get("status")
        if w["case"] != "slow_body" and status is not None and 200 <= status < 300:
            out.append({"bad_input": w["case"], "what": [f"answered {status}"]})
    return out


def _backlog(db: dict[str, Any], js: dict[str, Any],
             services: dict[str, Service]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"outbox": r["kind"], "status": r["status"], "rows": r["n"]} for r in db["outbox"]
        if r["status"] in ("pending", "publishing", "published")]
    if "error" in js:
        out.append({"jetstream": "unreadable", "error": js["error"]})
    for stream, info in js.items():
        if not isinstance(info, dict) or info.get("missing"):
            continue
        if info.get("messages"):
            out.append({"stream": stream, "messages": info["messages"]})
        for name, c in (info.get("consumers") or {}).items():
            if c["num_pending"] or c["num_ack_pending"]:
                out.append({"stream": stream, "consumer": name, **c})
    for m in _memory(services):
        if m.get("growing"):
            out.append({"memory": m["service"], **m})
    return out


def _memory(services: dict[str, Service]) -> list[dict[str, Any]]:
    """Resident memory per incarnation: flagged if it kept growing to well over its start."""
    out = []
    for s in services.values():
        if s.kind in ("nats",):
            continue
        for i, inc in enumerate(s.incarnations, 1):
            if len(inc.rss) < 3:
                continue
            first, peak, last = inc.rss[0][1], max(r for _, r in inc.rss), inc.rss[-1][1]
            growing = last > 2.5 * first and last > 400 * 2**20
            out.append({"service": s.name, "incarnation": i, "samples": len(inc.rss),
                        "first_mib": round(first / 2**20, 1), "peak_mib": round(peak / 2**20, 1),
                        "last_mib": round(last / 2**20, 1), "growing": growing})
    return out


def _bad_input_checks(cfg: ChaosConfig, bad: dict[str, Any], db: dict[str, Any],
                      fault_records: list[dict[str, Any]]) -> dict[str, Any]:
    if not bad.get("ran"):
        return {"ran": False}
    letters = {(d["consumer"], d["message_id"]): d for d in db["dead_letters"]}
    # A poison message that the stream_delete fault removed cannot be dead-lettered.
    deleted = {(r.get("result") or {}).get("message_id") for r in fault_records
               if r["kind"] == "stream_delete"}
    missing, over = [], []
    for m in bad["jetstream"]:
        if not m["published"]:
            missing.append({**m, "why": "could not be published"})
            continue
        if m["message_id"] in deleted:
            continue
        d = letters.get((m["consumer"], m["message_id"]))
        if d is None:
            missing.append({k: m[k] for k in ("target", "payload", "message_id", "consumer")})
        elif d["deliveries"] > 20:
            over.append({"message_id": m["message_id"], "deliveries": d["deliveries"]})
    rpc_bad = [r for r in bad["rpc"] if not r.get("error_reply")]
    # A slow body is a valid webhook sent slowly: 2xx, or 503 if the broker was down.
    hooks_bad = [w for w in bad["webhooks"]
                 if (w.get("status") is None or not 400 <= w["status"] < 500)
                 and not (w["case"] == "slow_body" and w.get("status") is not None
                          and (w["status"] < 500 or w["status"] == 503))]
    slow: dict[str, Any] = next((w for w in bad["webhooks"] if w["case"] == "slow_body"), {})
    too_large_ok = all(t["refused"] for t in bad["too_large"])
    checks = {
        "poison_dead_lettered": not missing,
        "deliveries_bounded_by_max_deliver": not over,
        "rpc_error_replies": not rpc_bad,
        "webhooks_refused_4xx": not hooks_bad,
        "webhook_endpoint_responsive_during_slow_body": bool(slow.get("stayed_responsive")),
        "oversized_refused_at_publish": too_large_ok,
    }
    return {"ran": True, "ok": all(checks.values()), "checks": checks,
            "jetstream_messages": len(bad["jetstream"]),
            "dead_lettered": len(bad["jetstream"]) - len(missing),
            "not_dead_lettered": missing[:EXAMPLES], "over_max_deliver": over[:EXAMPLES],
            "rpc_without_error_reply": rpc_bad[:EXAMPLES], "webhooks_not_4xx": hooks_bad,
            "too_large": bad["too_large"], "slow_body": slow,
            "max_deliver": 20}

def forged_effects(db: dict[str, Any], sandbox_keys: dict[str, Any],
                   requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eleventh invariant's evidence, from the final state (pure): every forged message
    that moved an operation (a journaled state change by a forged actor, a granted forged
    claim, a stored forged webhook, an operation in the forged tenant) or reached the
    provider (a request or an effect under a forged key)."""
    found: list[dict[str, Any]] = []
    for e in db["journal"]:
        actor = str(e.get("actor") or "")
        # (An operation's creation, from no state, is counted below by its tenant.)
        if (FORGED in actor and e.get("from_state") and e.get("to_state")
                and e["to_state"] != e["from_state"]):
            found.append({"what": "state change by a forged sender", "actor": actor,
                          "operation_id": e["operation_id"], "to_state": e["to_state"]})
    for a in db["attempts"]:
        if str(a.get("dispatcher_id") or "").startswith(FORGED):
            found.append({"what": "forged claim granted", "attempt_id": a["id"],
                          "operation_id": a["operation_id"]})
    for w in db["webhook_events"]:
        # Kept but marked refused (another provider's, or one no tool names: validly signed
        # by a provider the deployment takes webhooks from) can never be applied; anything
        # else stored can.
        if (str(w.get("webhook_id") or "").startswith(FORGED)
                and not str(w.get("applied") or "").startswith("refused")):
            found.append({"what": "forged webhook stored", "webhook_id": w["webhook_id"],
                          "operation_id": w.get("operation_id"), "applied": w.get("applied")})
    for d in db["dead_letters"]:
        if REPLY_MARK in str(d.get("payload_excerpt") or ""):
            found.append({"what": "ledger answer written into a stream",
                          "subject": d.get("subject"), "consumer": d.get("consumer")})
    for o in db["operations"]:
        if str(o.get("tenant") or "").startswith(FORGED):
            found.append({"what": "intent created in another tenant",
                          "operation_id": o["id"], "tenant": o["tenant"]})
    keys = {k for k in sandbox_keys if k.startswith(FORGED)}
    keys |= {str(r["key"]) for r in requests if str(r.get("key") or "").startswith(FORGED)}
    for k in sorted(keys):
        found.append({"what": "forged command reached the provider", "operation_key": k})
    return found
