"""The AOF reader (:mod:`tests.chaos.aof`) on what a real Redis and kombu write.

The replay of a real kombu queue's commands accounts for every message, and
names the one a consumer popped and never recorded as unacked.

The AOF replay (:mod:`tests.chaos.aof`) proves a transport loss only when it
holds the broker's whole history, that is when the base file Redis wrote at
its first start holds no key. Redis writes that base as an RDB preamble whose
auxiliary fields carry the server's clock (``ctime``) and memory use
(``used-mem``) as binary integers, so any byte value can appear there: a byte
search for the SELECTDB opcode (0xFE) would take an empty base for a full one,
and the chaos run would then count the tasks the Redis transport lost as lost
by the plugin. Hence these tests on bases a real Redis writes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import redis
from hypothesis import example, given
from hypothesis import strategies as st

from tests.chaos import aof
from tests.servers import RedisServer, wait_for

BROKER_ARGS = ["--auto-aof-rewrite-percentage", "0"]  # as the chaos broker runs


def _rdb_string(value: bytes | int) -> bytes:
    """``value`` as Redis's ``rdbSaveRawString`` writes it (no LZF: values are short)."""
    if isinstance(value, int):
        for code, fmt, lo, hi in ((0, "<b", -(2**7), 2**7), (1, "<h", -(2**15), 2**15),
                                  (2, "<i", -(2**31), 2**31)):  # fmt: skip
            if lo <= value < hi:
                return bytes([0xC0 | code]) + struct.pack(fmt, value)
        value = str(value).encode()
    n = len(value)
    if n < 64:
        head = bytes([n])
    elif n < 16384:
        head = bytes([0x40 | (n >> 8), n & 0xFF])
    else:
        head = b"\x80" + struct.pack(">I", n)
    return head + value


def _preamble(aux: list[tuple[bytes, bytes | int]], body: bytes = b"") -> bytes:
    fields = b"".join(b"\xfa" + _rdb_string(k) + _rdb_string(v) for k, v in aux)
    return b"REDIS0010" + fields + body + b"\xff" + b"\x00" * 8  # checksum not read


def _base(tmp_path: Path, data: bytes) -> Path:
    adir = tmp_path / "appendonlydir"
    adir.mkdir(exist_ok=True)
    (adir / "appendonly.aof.manifest").write_text(
        "file appendonly.aof.1.base.rdb seq 1 type b\nfile appendonly.aof.1.incr.aof seq 1 type i\n"
    )
    (adir / "appendonly.aof.1.base.rdb").write_bytes(data)
    (adir / "appendonly.aof.1.incr.aof").write_bytes(b"")
    return tmp_path


@given(
    ctime=st.integers(0, 2**32),
    used_mem=st.integers(0, 2**40),
    version=st.sampled_from([b"7.0.15", b"7.2.4", b"8.0.1"]),
)
@example(ctime=0x6B14FE48, used_mem=0x0DB5D8, version=b"7.0.15")  # 0xFE in the clock
@example(ctime=0x6B142A48, used_mem=0x0DFEF8, version=b"7.0.15")  # 0xFE in used-mem
def test_an_empty_base_is_empty_whatever_bytes_its_aux_fields_hold(
    ctime: int, used_mem: int, version: bytes
) -> None:
    aux = [(b"redis-ver", version), (b"redis-bits", 64), (b"ctime", ctime),
           (b"used-mem", used_mem), (b"aof-base", 1)]  # fmt: skip
    data = _preamble(aux)
    assert aof.rdb_is_empty(data)
    # The same preamble with one key in database 0 (SELECTDB 0, RESIZEDB 1 0,
    # a string key) is not.
    assert not aof.rdb_is_empty(
        _preamble(aux, b"\xfe\x00\xfb\x01\x00\x00" + _rdb_string(b"k") + _rdb_string(b"v"))
    )


def test_a_base_cut_short_is_not_taken_for_empty() -> None:
    data = _preamble([(b"redis-ver", b"7.0.15"), (b"ctime", 1796483656)])
    for end in range(len(b"REDIS0010"), data.index(b"\xff")):
        assert not aof.rdb_is_empty(data[:end]), end


def test_the_base_a_fresh_broker_writes_is_empty(
    make_redis_server: Callable[..., RedisServer], tmp_path: Path
) -> None:
    server = make_redis_server(extra_args=BROKER_ARGS)
    server.command("LPUSH", "celery", "m1")  # into the increment file, not the base
    files, base_empty = aof.aof_files(server.data_dir)
    assert base_empty, (server.data_dir / "appendonlydir").iterdir()
    assert [p.suffix for p in files] == [".aof"]
    # ... and with a clock byte 0xFE written into its ctime field, still empty.
    base = next((server.data_dir / "appendonlydir").glob("*.base.rdb")).read_bytes()
    at = base.index(b"ctime") + len(b"ctime")
    assert base[at] == 0xC2, base  # an int32, as Redis 7 writes its clock
    forged = base[: at + 1] + b"\xfe" + base[at + 2 :]
    assert b"\xfe" in forged[9:-9]  # what the byte search took for a SELECTDB
    assert aof.aof_files(_base(tmp_path, forged))[1]


def test_a_base_rewritten_with_data_is_not_empty(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server(extra_args=BROKER_ARGS)
    server.command("LPUSH", "celery", "m1")
    adir = server.data_dir / "appendonlydir"
    before = {p.name for p in adir.glob("*.base.*")}
    client = redis.Redis.from_url(server.url())
    try:
        client.bgrewriteaof()
        wait_for(
            lambda: (
                {p.name for p in adir.glob("*.base.*")} - before
                and client.info("persistence")["aof_rewrite_in_progress"] == 0
            ),
            30,
            "the AOF rewrite to write a new base",
        )
    finally:
        client.close()
    assert not aof.aof_files(server.data_dir)[1]  # the list is in the new base


def test_the_replay_of_a_real_kombu_queue_accounts_for_every_message(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    from kombu import Connection

    server = make_redis_server(extra_args=BROKER_ARGS)
    with Connection(server.url()) as conn:
        queue = conn.SimpleQueue("celery")
        for i in range(6):
            queue.put({"n": i})
        acked = [queue.get(timeout=5) for _ in range(2)]
        for m in acked:
            m.ack()
        queue.get(timeout=5).requeue()  # restored: pushed back, same delivery tag
        # The transport's loss window: a message popped and never recorded as
        # unacked (a consumer killed between its BRPOP and its HSET).
        popped = redis.Redis.from_url(server.url()).rpop("celery")
        queue.close()
    assert popped is not None
    files, base_empty = aof.aof_files(server.data_dir)
    log = aof.analyze(files, base_empty=base_empty)
    assert log.complete and log.divergent == 0
    lost = [m.tag for m in log.lost_messages]
    assert lost == [json.loads(popped)["properties"]["delivery_tag"]]
    assert len(log.messages) == 6
    assert log.queued_at_end == 3 and log.unacked_at_end == 0
