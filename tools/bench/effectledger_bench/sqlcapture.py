"""The SQL one operation costs, captured from the running ledger and replayed with pgbench.

How: for a handful of operations submitted one at a time on an otherwise idle system, the
private PostgreSQL logs every statement (`log_statement = all`, prefix `%m [%p] %x `). This
module parses that log, substitutes the logged bind parameters into the statements, groups
them by backend into transactions, and keeps the transactions that touch the operation (found
transitively from the operation id: the outbox id is in the submit transaction, the attempt id
in the claim transaction). The connection pool's pre-ping (`BEGIN; ROLLBACK;` before each
checkout) is kept with the transaction it precedes: the ledger really pays it.

The result becomes a pgbench script in which each per-operation identifier (operation, outbox
and attempt ids, operation key, caller key) is replaced by a value unique per pgbench
transaction, so that one pgbench "transaction" replays exactly one operation's statements and
transactions against the same schema. Nothing is guessed: the statements are the ones logged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ \S+) \[(\d+)\] (\d+) "
                   r"(LOG|DETAIL|ERROR|STATEMENT|HINT|WARNING|CONTEXT):  (.*)$")
_PARAM = re.compile(r"\$(\d+) = (NULL|'(?:[^']|'')*')", re.S)
_PLACEHOLDER = re.compile(r"\$(\d+)\b")
_HEX_ID = re.compile(r"\b[0-9a-f]{32}\b")
_OP_KEY = re.compile(r"\bck_[0-9a-f]{40}\b|\bop_[0-9a-f]{32}\b")


@dataclass
class Entry:
    at: str
    pid: int
    level: str
    message: str


@dataclass
class Statement:
    at: str
    pid: int
    sql: str


@dataclass
class Txn:
    pid: int
    at: str
    statements: list[Statement] = field(default_factory=list)
    preping: bool = False  # preceded by the pool's BEGIN; ROLLBACK; ping

    @property
    def text(self) -> str:
        return "\n".join(s.sql for s in self.statements)


def parse_log(text: str) -> list[Entry]:
    entries: list[Entry] = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            entries.append(Entry(m.group(1), int(m.group(2)), m.group(4), m.group(5)))
        elif entries and line.startswith("\t"):
            entries[-1].message += "\n" + line[1:]
    return entries


def substitute(sql: str, params: dict[int, str]) -> str:
    """Put logged literal parameter values in place of $n placeholders."""
    return _PLACEHOLDER.sub(lambda m: params.get(int(m.group(1)), m.group(0)), sql)


# asyncpg's type introspection: the first time a connection meets a parameter type it has no
# codec for yet (an array of VARCHAR, of TIMESTAMPTZ) it looks the type up with JIT switched off
# for the lookup, and caches the answer for the connection's life. A one-off per connection and
# type, not part of any operation's cost: replayed by pgbench it would be paid every time.
_DRIVER_INTROSPECTION = ("typeinfo_tree", "set_config('jit'")


def is_driver_introspection(sql: str) -> bool:
    return any(marker in sql for marker in _DRIVER_INTROSPECTION)


def statements(entries: list[Entry]) -> list[Statement]:
    """Executed statements with their parameters substituted, in log order (without the
    driver's one-off type introspection)."""
    out: list[Statement] = []
    pending: dict[int, Statement] = {}  # an `execute` waiting for its DETAIL parameters
    for e in entries:
        if e.level == "LOG":
            if e.message.startswith("statement: "):
                sql = e.message[len("statement: "):]
            elif e.message.startswith("execute "):
                sql = e.message.split(": ", 1)[1]
            else:
                continue
            st = Statement(e.at, e.pid, sql.strip())
            if not is_driver_introspection(st.sql):
                out.append(st)
            pending[e.pid] = st  # its parameters still follow; they are dropped with it
        elif e.level == "DETAIL" and e.message.startswith("parameters: ") and e.pid in pending:
            params = {int(n): v for n, v in _PARAM.findall(e.message)}
            pending[e.pid].sql = substitute(pending[e.pid].sql, params)
            del pending[e.pid]
    return out


def _verb(sql: str) -> str:
    return sql.strip().rstrip(";").strip().upper()


def transactions(stmts: list[Statement]) -> list[Txn]:
    """Group statements per backend into BEGIN..COMMIT transactions (pre-pings folded in).

    A statement outside any BEGIN is a transaction of its own (PostgreSQL commits it when it
    returns): the ledger sends a keyed intent's read and its fused writes that way."""
    open_txn: dict[int, Txn] = {}
    pinged: dict[int, bool] = {}
    done: list[Txn] = []
    for st in stmts:
        verb = _verb(st.sql)
        if verb.startswith("BEGIN"):
            open_txn[st.pid] = Txn(st.pid, st.at, [st], preping=pinged.pop(st.pid, False))
        elif verb in ("COMMIT", "ROLLBACK") and st.pid in open_txn:
            txn = open_txn.pop(st.pid)
            txn.statements.append(st)
            if verb == "ROLLBACK" and len(txn.statements) == 2:
                pinged[st.pid] = True  # an empty transaction: the pool's pre-ping
            else:
                done.append(txn)
        elif st.pid in open_txn:
            open_txn[st.pid].statements.append(st)
        else:
            done.append(Txn(st.pid, st.at, [st], preping=pinged.pop(st.pid, False)))
    return sorted(done, key=lambda t: t.at)


def operation_transactions(txns: list[Txn], operation_id: str) -> tuple[list[Txn], set[str]]:
    """The transactions that touch one operation, and the identifiers that belong to it."""
    ids = {operation_id}
    chosen: list[Txn] = []
    changed = True
    while changed:
        changed = False
        for t in txns:
            if t in chosen:
                continue
            text = t.text
            if any(i in text for i in ids):
                chosen.append(t)
                new = set(_HEX_ID.findall(text)) | set(_OP_KEY.findall(text))
                if not new <= ids:
                    ids |= new
                changed = True
    return sorted(chosen, key=lambda t: t.at), ids


def shape(txns: list[Txn]) -> list[str]:
    """A comparable signature: each transaction's statement verbs and tables."""
    out = []
    for t in txns:
        parts = []
        for s in t.statements:
            if _verb(s.sql) in ("BEGIN", "COMMIT", "ROLLBACK"):
                continue
            words = re.findall(r"\b(INSERT INTO \w+|UPDATE \w+|SELECT pg_notify|FROM \w+)\b",
                               s.sql)
            parts.append(words[0] if words else s.sql.split()[0])
        out.append(("ping+" if t.preping else "") + "|".join(parts))
    return out


def pgbench_script(txns: list[Txn], ids: set[str], replacements: dict[str, str] | None = None
                   ) -> str:
    """A pgbench script replaying `txns`, with each identifier made unique per transaction."""
    names: dict[str, str] = {}
    counter = 0
    for ident in sorted(ids, key=lambda s: (-len(s), s)):
        counter += 1
        names[ident] = f"b{counter}-:client_id-:n"
    for literal, template in (replacements or {}).items():
        names[literal] = template
    lines = [
        "-- effectledger: the SQL of one operation, captured from the ledger's own statements",
        "-- (log_statement=all); per-operation identifiers are unique per pgbench transaction.",
        r"\set n random(1, 9000000000000000000)",
    ]
    for t in txns:
        lines.append(f"-- transaction at {t.at} on backend {t.pid}")
        if t.preping:
            lines += ["BEGIN;", "ROLLBACK;"]
        for st in t.statements:
            sql = st.sql.rstrip().rstrip(";")
            for ident in sorted(names, key=len, reverse=True):
                sql = sql.replace(ident, names[ident])
            lines.append(sql + ";")
    return "\n".join(lines) + "\n"


@dataclass
class Capture:
    per_op: list[tuple[str, list[Txn], set[str]]]  # (operation id, transactions, identifiers)
    shapes: list[list[str]]
    consistent: bool  # every captured operation had the same transactions and statements


def extract(log_text: str, operation_ids: list[str]) -> Capture:
    """For each captured operation: its transactions; checks that they all share one shape."""
    txns = transactions(statements(parse_log(log_text)))
    per_op = []
    for op_id in operation_ids:
        chosen, ids = operation_transactions(txns, op_id)
        per_op.append((op_id, chosen, ids))
    shapes = [shape(c) for _, c, _ in per_op]
    return Capture(per_op, shapes, all(s == shapes[0] for s in shapes))
