"""What the Redis broker's own append-only file proves about lost messages.

The broker runs with ``appendonly yes``, ``appendfsync always`` and automatic
AOF rewrites off, so its AOF holds every write command it ever executed, in
order, fsync'd before the reply left the server. kombu's Redis transport:

* publishes with ``LPUSH queue payload`` (restores with ``RPUSH``/``LPUSH``
  of the same payload, same ``delivery_tag``);
* consumes with ``BRPOP``, which the AOF records as ``RPOP queue``;
* then, in a second round trip, records the message as unacked:
  ``HSET unacked <delivery_tag> [payload, exchange, routing_key]``;
* acks with ``HDEL unacked <tag>``; restores atomically (``MULTI``: ``HDEL``
  plus a push of the payload).

So the AOF alone shows the transport's loss window (CELERY_FACTS.md, "Broker
faults"): a message *popped* (``RPOP`` of its payload, found by replaying the
queue lists) and never afterwards recorded as unacked was lost by the
transport: the worker never got it (connection killed, broker restarted,
worker killed in between) and nothing can restore it.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BrokerLog", "Message", "analyze", "aof_files", "rdb_is_empty", "read_commands"]

UNACKED = b"unacked"


@dataclass
class Message:
    tag: str
    task_id: str | None
    published: int = 0  # pushes (first publish and restores)
    popped: int = 0
    unacked: int = 0
    lost: int = 0  # pops never followed by an unacked record


@dataclass
class BrokerLog:
    messages: dict[str, Message] = field(default_factory=dict)
    complete: bool = True  # False if the history before the AOF base is unknown
    commands: int = 0
    divergent: int = 0  # pops the replay could not match (history incomplete)
    queued_at_end: int = 0
    unacked_at_end: int = 0
    pending_at_end: set[str] = field(default_factory=set)  # task ids queued/unacked at the end
    #: unacked at the end with a restore time in the future: tag -> (task id, seconds)
    stranded: dict[str, tuple[str | None, float]] = field(default_factory=dict)

    @property
    def lost_messages(self) -> list[Message]:
        return [m for m in self.messages.values() if m.lost]

    def transport_lost(self) -> dict[str, str]:
        """Task id -> evidence, for every task id the transport lost a message of."""
        out: dict[str, str] = {}
        if not self.complete or self.divergent:
            return out
        for m in self.lost_messages:
            if m.task_id is not None:
                out[m.task_id] = (
                    f"message {m.tag} popped {m.popped}x, recorded unacked {m.unacked}x "
                    f"(broker AOF)"
                )
        for tag, (task_id, seconds) in self.stranded.items():
            if task_id is not None and task_id not in out:
                out[task_id] = (
                    f"message {tag} held unacked by the transport, restorable only in "
                    f"{seconds:.0f}s: its unacked_index score was taken from the clock of a "
                    "worker running ahead (broker AOF)"
                )
        return out


def aof_files(data_dir: Path) -> tuple[list[Path], bool]:
    """The AOF increment files in order, and whether the base file is empty.

    Redis 7 keeps a manifest in ``appendonlydir``: one base file (an RDB
    preamble when ``aof-use-rdb-preamble`` is on) and increment files.
    """
    adir = data_dir / "appendonlydir"
    manifests = sorted(adir.glob("*.manifest"))
    if not manifests:
        legacy = data_dir / "appendonly.aof"
        return ([legacy] if legacy.exists() else []), True
    files: list[Path] = []
    base_empty = True
    for line in manifests[0].read_text().splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[0] != "file":
            continue
        name, kind = parts[1], parts[parts.index("type") + 1]
        path = adir / name
        if kind == "b":
            base_empty = _base_is_empty(path)
        elif kind == "i":
            files.append(path)
    return files, base_empty


def _base_is_empty(path: Path) -> bool:
    if not path.exists():
        return True
    data = path.read_bytes()
    if data.startswith(b"REDIS"):
        return rdb_is_empty(data)
    return not data.strip()


_AUX, _EOF = 0xFA, 0xFF


def rdb_is_empty(data: bytes) -> bool:
    """True when the RDB ``data`` (an AOF base's preamble) holds no key.

    Read opcode by opcode: the header, auxiliary fields (``redis-ver``,
    ``ctime``, ``used-mem``, ...), then EOF. The auxiliary values include the
    server's clock and memory as binary integers, so any byte can appear among
    them; only parsing tells a field from a SELECTDB. Anything else before EOF
    (a database, a function, a module's data) or a file cut short is "not
    empty": the replay then proves nothing rather than something false.
    """
    pos = 9  # b"REDIS" and four version digits
    try:
        while data[pos] == _AUX:
            pos = _skip_string(data, _skip_string(data, pos + 1))
        return data[pos] == _EOF
    except (IndexError, ValueError):  # cut short, or not a preamble this reader knows
        return False


def _length(data: bytes, pos: int) -> tuple[int, int, bool]:
    """The RDB length at ``pos``: (value, position after it, whether it is a
    special encoding, whose value is then the encoding's number)."""
    first = data[pos]
    kind, low = first >> 6, first & 0x3F
    if kind == 0:
        return low, pos + 1, False
    if kind == 1:
        return low << 8 | data[pos + 1], pos + 2, False
    if kind == 3:
        return low, pos + 1, True
    width = {0x80: 4, 0x81: 8}.get(first)
    if width is None:
        raise ValueError(f"unknown RDB length byte {first:#x}")
    return int.from_bytes(data[pos + 1 : pos + 1 + width], "big"), pos + 1 + width, False


def _skip_string(data: bytes, pos: int) -> int:
    """The position after the RDB string at ``pos``: length-prefixed bytes, an
    int8/16/32, or LZF (compressed length, uncompressed length, the bytes)."""
    value, pos, special = _length(data, pos)
    if not special:
        end = pos + value
    elif value in (0, 1, 2):
        end = pos + (1, 2, 4)[value]
    elif value == 3:
        compressed, pos, _ = _length(data, pos)
        end = _length(data, pos)[1] + compressed
    else:
        raise ValueError(f"unknown RDB string encoding {value}")
    if end > len(data):
        raise ValueError("RDB string runs past the end")
    return end


def read_commands(path: Path) -> Iterator[list[bytes]]:
    """The commands of one AOF file (RESP arrays of bulk strings); stops at a torn tail."""
    data = path.read_bytes()
    pos, n = 0, len(data)
    while pos < n:
        if data[pos : pos + 1] != b"*":
            return  # torn or not an AOF
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return
        count = int(data[pos + 1 : eol])
        pos = eol + 2
        args: list[bytes] = []
        for _ in range(count):
            eol = data.find(b"\r\n", pos)
            if eol < 0 or data[pos : pos + 1] != b"$":
                return
            size = int(data[pos + 1 : eol])
            start = eol + 2
            if start + size + 2 > n:
                return
            args.append(data[start : start + size])
            pos = start + size + 2
        yield args


def _identify(payload: bytes) -> tuple[str, str | None] | None:
    try:
        msg = json.loads(payload)
        tag = msg["properties"]["delivery_tag"]
    except (ValueError, KeyError, TypeError):
        return None
    headers = msg.get("headers") or {}
    return str(tag), headers.get("id")


def analyze(
    files: list[Path],
    *,
    base_empty: bool = True,
    db: int = 0,
    now: float | None = None,
    visibility_timeout: float | None = None,
) -> BrokerLog:
    """Replay the queue lists of database ``db`` and account for every message.

    With ``now`` and ``visibility_timeout``, a message still unacked at the
    end whose ``unacked_index`` score (the consuming worker's ``time()``)
    puts its restore after ``now`` is *stranded*: kombu restores a message
    only once ``time() - visibility_timeout`` passes its score, so one
    recorded by a worker whose clock ran an hour ahead stays an hour.
    """
    log = BrokerLog(complete=base_empty)
    lists: dict[bytes, deque[bytes]] = defaultdict(deque)
    pending_pop: dict[str, int] = {}  # tag -> pops not yet recorded unacked
    unacked: dict[bytes, bytes] = {}
    scores: dict[bytes, float] = {}
    current = 0

    def message(payload: bytes) -> Message | None:
        ident = _identify(payload)
        if ident is None:
            return None
        tag, task_id = ident
        m = log.messages.get(tag)
        if m is None:
            m = log.messages[tag] = Message(tag, task_id)
        return m

    for path in files:
        for cmd in read_commands(path):
            log.commands += 1
            name = cmd[0].upper()
            if name == b"SELECT":
                current = int(cmd[1])
                continue
            if current != db:
                continue
            if name in (b"LPUSH", b"RPUSH"):
                key = cmd[1]
                for payload in cmd[2:]:
                    if name == b"LPUSH":
                        lists[key].appendleft(payload)
                    else:
                        lists[key].append(payload)
                    m = message(payload)
                    if m is not None:
                        m.published += 1
                        if pending_pop.pop(m.tag, 0):
                            m.lost += 1  # popped, never unacked, then pushed again
            elif name in (b"RPOP", b"LPOP"):
                key = cmd[1]
                count = int(cmd[2]) if len(cmd) > 2 else 1
                for _ in range(count):
                    if not lists[key]:
                        log.divergent += 1
                        break
                    payload = lists[key].pop() if name == b"RPOP" else lists[key].popleft()
                    m = message(payload)
                    if m is not None:
                        m.popped += 1
                        if pending_pop.get(m.tag):
                            m.lost += 1
                        pending_pop[m.tag] = 1
            elif name == b"HSET" and cmd[1] == UNACKED:
                for i in range(2, len(cmd) - 1, 2):
                    tag = cmd[i].decode()
                    unacked[cmd[i]] = cmd[i + 1]
                    pending_pop.pop(tag, None)
                    m = log.messages.get(tag)
                    if m is None:
                        try:
                            payload = json.dumps(json.loads(cmd[i + 1])[0]).encode()
                        except (ValueError, IndexError, TypeError):
                            continue
                        m = message(payload)
                    if m is not None:
                        m.unacked += 1
            elif name == b"ZADD" and cmd[1] == UNACKED + b"_index":
                args = [a for a in cmd[2:] if a.upper() not in (b"NX", b"XX", b"GT", b"LT", b"CH")]
                for i in range(0, len(args) - 1, 2):
                    try:
                        scores[args[i + 1]] = float(args[i])
                    except ValueError:
                        continue
            elif name == b"HDEL" and cmd[1] == UNACKED:
                for f in cmd[2:]:
                    unacked.pop(f, None)
            elif name in (b"DEL", b"UNLINK"):
                for key in cmd[1:]:
                    lists.pop(key, None)
                    if key == UNACKED:
                        unacked.clear()
            elif name == b"FLUSHDB" or name == b"FLUSHALL":
                lists.clear()
                unacked.clear()
    for tag in pending_pop:
        log.messages[tag].lost += 1
    for items in lists.values():
        for payload in items:
            log.queued_at_end += 1
            ident = _identify(payload)
            if ident and ident[1]:
                log.pending_at_end.add(ident[1])
    for field_, value in unacked.items():
        log.unacked_at_end += 1
        try:
            payload = json.dumps(json.loads(value)[0]).encode()
        except (ValueError, IndexError, TypeError):
            continue
        ident = _identify(payload)
        if ident and ident[1]:
            log.pending_at_end.add(ident[1])
        score = scores.get(field_)
        if now is not None and visibility_timeout is not None and score is not None:
            restore_in = score + visibility_timeout - now
            if restore_in > 0:
                log.stranded[field_.decode()] = (ident[1] if ident else None, restore_in)
    return log
