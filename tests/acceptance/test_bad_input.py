"""Bad input: settings, task options, keys of any content and length, metacharacters.

* Every ``lease_*`` setting is validated (types, ranges, policy names,
  parseable URLs, client options) with an error naming the setting and what
  it accepts; the table below must cover every setting the package knows, so
  a new setting cannot ship unchecked. Every setting, misspelt, warns naming it.
* A task option the timer would refuse (a renew interval above half the TTL)
  fails before the claim, on a real worker, and leaves the key free.
* Keys of any Unicode and any length -- emoji, RTL and combining text, NUL, a
  lone surrogate, 10 000 characters -- work end to end on every store: claim,
  inspect, list, renew, release, commit and read back; the ones no store keeps
  verbatim are held as ``<prefix>~<sha256>``, deterministically and distinctly.
* Nothing a caller passes reaches Lua or SQL except as a parameter: keys made
  of quotes, ``%``, ``_``, ``*``, ``?``, ``[``, ``{``, ``}``, ``\\``, Lua
  long-bracket and SQL comment syntax claim, list and inspect correctly, leave
  every other key and the tables untouched, and ``list(prefix=...)`` with glob
  or LIKE metacharacters (or another letter case) matches literally.
* Worker level: a worker refuses to start with an unparseable store URL or a
  misspelt client option; tasks with such keys run on a real worker and their
  results are accepted.
"""

# ruff: noqa: E501 -- the table of bad settings reads best one case per line
from __future__ import annotations

import hashlib
import json
import math
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_lease
from celery_lease import LeaseConfigError, LeaseStore
from celery_lease.config import SETTINGS, Config
from celery_lease.keys import MAX_KEY_LENGTH, has_unstorable, shorten
from celery_lease.results import ResultTable
from tests.apps.tenantapp import build_tenant
from tests.sec_cluster import Cluster
from tests.servers import RedisServer
from tests.store_fixtures import STORE_KINDS, store_url
from tests.workers import Worker

pytestmark = pytest.mark.timeout(120)

# --------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------

SQLITE = "sqlite:///x.sqlite3"

#: (settings, the error: names the setting and says what is accepted)
BAD_SETTINGS: list[tuple[dict[str, Any], str]] = [
    ({"lease_store_url": 42}, r"lease_store_url must be a URL such as redis://host:6379/1"),
    ({"lease_store_url": "mongodb://x"}, r"lease_store_url: unknown URL scheme 'mongodb'.*known: redis"),
    ({"lease_store_url": "redis://h:notaport/1"}, r"lease_store_url: cannot parse .*Port could not"),
    ({"lease_store_url": "redis://h:99999/1"}, r"lease_store_url: cannot parse .*Port out of range"),
    ({"lease_store_url": "redis://h/one"}, r"lease_store_url: the path .* must be a Redis database number"),
    ({"lease_store_url": "redis://u:pw@h/x"}, r"lease_store_url: the path of redis://u:\*\*\*@h/x"),
    ({"lease_store_url": "unix://"}, r"lease_store_url: unix:// names no socket path"),
    ({"lease_store_url": "sqlite://"}, r"lease_store_url: sqlite:// names no file; .*sqlite:///path"),
    ({"lease_store_url": "postgresql+psycopg://h:0x/db"}, r"lease_store_url: cannot parse"),
    ({"lease_store_url": "postgresql+psycopg://h:70000/db"}, r"lease_store_url: port 70000 .* not a TCP port \(1-65535\)"),
    ({"lease_store_url": "postgresql+psycopg://h"}, r"lease_store_url: .* names no database \(postgresql\+psycopg://host/dbname\)"),
    ({"lease_result_url": "redis://127.0.0.1/1"}, r"lease_result_url must be a SQL database \(postgresql\+psycopg://\.\.\. or sqlite:///\.\.\.\)"),
    ({"lease_result_url": "sqlite:///:memory:"}, r"lease_result_url: .* names no file"),
    ({"lease_ttl": 0}, r"lease_ttl must be greater than 0, got 0"),
    ({"lease_ttl": "30"}, r"lease_ttl must be a number of seconds, got '30'"),
    ({"lease_ttl": math.inf}, r"lease_ttl must be a finite number, got inf"),
    ({"lease_ttl": math.nan}, r"lease_ttl must be a finite number, got nan"),
    ({"lease_ttl": 3, "lease_renew_interval": 1.6}, r"lease_renew_interval \(1.6\) must be at most half the TTL \(3.0\)"),
    ({"lease_renew_interval": 16}, r"lease_renew_interval \(16.0\) must be at most half the TTL \(30.0\)"),
    ({"lease_renew_interval": -1}, r"lease_renew_interval must be greater than 0, got -1"),
    ({"lease_mode": "sometimes"}, r"lease_mode must be one of exclusive, once; got 'sometimes'"),
    ({"lease_mode": None, "lease_on_conflict": "queue"}, r"lease_on_conflict must be one of defer, reject, wait; got 'queue'"),
    ({"lease_on_duplicate": "drop"}, r"lease_on_duplicate must be one of reject, return; got 'drop'"),
    ({"lease_key_prefix": ""}, r"lease_key_prefix must be a non-empty string, got ''"),
    ({"lease_key_prefix": 5}, r"lease_key_prefix must be a non-empty string, got 5"),
    ({"lease_key_prefix": "app{x}"}, r"lease_key_prefix must not contain '\{' or '\}' \(Redis Cluster hash tags\)"),
    ({"lease_send_events": "yes"}, r"lease_send_events must be True or False, got 'yes'"),
    ({"lease_ttl": 3, "lease_clock_drift": 3}, r"lease_clock_drift must be >= 0 and below lease_ttl \(3.0\), got 3"),
    ({"lease_clock_drift": -0.1}, r"lease_clock_drift must not be negative, got -0.1"),
    ({"lease_ttl": 30, "lease_clock_drift": 21}, r"lease_renew_interval \(10 = TTL / 3, the default\) does not fit lease_ttl \(30\) less lease_clock_drift \(21\): the local view of a lease ends 9 s after its claim"),
    ({"lease_ttl": 12, "lease_renew_interval": 6, "lease_clock_drift": 5.5}, r"lease_renew_interval \(6\) does not fit lease_ttl \(12\) less lease_clock_drift \(5.5\)"),
    ({"lease_ttl": 1e11}, r"lease_ttl must be at most 31536000 \(one year\), got 100000000000.0"),
    ({"lease_result_expires": -5}, r"lease_result_expires must be greater than 0, got -5"),
    ({"lease_result_expires": "1d"}, r"lease_result_expires must be a number of seconds, got '1d'"),
    ({"lease_result_max_bytes": 0}, r"lease_result_max_bytes must be greater than 0, got 0"),
    ({"lease_result_max_bytes": 0.5}, r"lease_result_max_bytes must be a whole number \(1, 2, \.\.\.\), got 0.5"),
    ({"lease_max_keys": 0}, r"lease_max_keys must be greater than 0, got 0"),
    ({"lease_max_key_length": 1.5}, r"lease_max_key_length must be a whole number \(1, 2, \.\.\.\), got 1.5"),
    ({"lease_defer_max": 2.5}, r"lease_defer_max must be a whole number \(1, 2, \.\.\.\), got 2.5"),
    ({"lease_defer_max": True}, r"lease_defer_max must be a number of seconds, got True"),
    ({"lease_wait_timeout": 0}, r"lease_wait_timeout must be greater than 0, got 0"),
    ({"lease_store_retry": -1}, r"lease_store_retry must not be negative, got -1"),
    ({"lease_store_retry": "5"}, r"lease_store_retry must be a number of seconds, got '5'"),
    ({"lease_metrics_port": 70000}, r"lease_metrics_port must be a TCP port number, got 70000"),
    ({"lease_metrics_port": "9808"}, r"lease_metrics_port must be a TCP port number, got '9808'"),
    ({"lease_metrics_addr": "0.0.0.0:9808"}, r"lease_metrics_addr must be an IP address or host name to listen on"),
    ({"lease_metrics_addr": 127001}, r"lease_metrics_addr must be an IP address or host name to listen on .*got 127001"),
    ({"lease_store_options": "ssl"}, r"lease_store_options must be a dict of client options, got str"),
    (
        {"lease_store_url": "redis://127.0.0.1:1/0", "lease_store_options": {"socket_timout": 1}},
        r"lease_store_options\).*unexpected keyword argument 'socket_timout'",
    ),
    (
        {"lease_store_url": "redis://127.0.0.1:1/0", "lease_store_options": {"key_prefix": "x"}},
        r"set lease_key_prefix, not lease_store_options\['key_prefix'\]",
    ),
    (
        {"lease_store_url": "postgresql+psycopg://h/db", "lease_store_options": {"sslmode": "x"}},
        r"lease_store_options applies to Redis lease stores only; .*\?sslmode=verify-full",
    ),
]  # fmt: skip


def _app(**settings: Any) -> Celery:
    app = Celery("bad-input", set_as_current=False)
    app.conf.update(settings)
    return app


@pytest.mark.parametrize(
    ("settings", "message"),
    BAD_SETTINGS,
    ids=[json.dumps(s, default=repr) for s, _ in BAD_SETTINGS],
)
def test_each_bad_setting_is_refused_naming_it(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(LeaseConfigError, match=message):
        Config.from_app(_app(**{"lease_store_url": SQLITE, **settings}))


def test_every_setting_has_a_bad_value_tried() -> None:
    """A new setting cannot ship without its validation being tried here."""
    tried = {name for settings, _ in BAD_SETTINGS for name in settings}
    assert set(SETTINGS) <= tried, f"no bad value tried for {set(SETTINGS) - tried}"


def test_good_edge_values_are_accepted() -> None:
    cfg = Config.from_app(
        _app(
            lease_store_url="redis://user:pw@127.0.0.1:6379/15",
            lease_result_url="postgresql://u@h:5432/db?sslmode=verify-full",
            lease_ttl=0.5,
            lease_renew_interval=0.25,
            lease_clock_drift=0,
            lease_result_max_bytes=1,
            lease_defer_max=1.0,
            lease_store_retry=0,
            lease_store_options={"socket_timeout": 2.0},
        )
    )
    assert (cfg.ttl, cfg.renew_interval, cfg.result_max_bytes, cfg.defer_max) == (0.5, 0.25, 1, 1)
    assert cfg.store_options == {"socket_timeout": 2.0}


def _typos(name: str) -> list[str]:
    return sorted({name[:-1], name[:6] + name[7:], name[:8] + name[8] + name[8:], name.upper()})


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_misspelt_setting_warns_naming_the_right_one(name: str) -> None:
    for typo in _typos(name):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Config.from_app(_app(lease_store_url=SQLITE, **{typo: 1}))
        messages = [str(w.message) for w in caught]
        expected = f"unknown celery-lease setting '{typo}'; did you mean '{name}'?"
        assert expected in messages, (typo, messages)


TASK_OPTION_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"lease_ttl": math.inf}, r"lease_ttl must be a positive number of seconds, got inf"),
    ({"lease_ttl": "30"}, r"lease_ttl must be a positive number of seconds, got '30'"),
    ({"lease_renew_interval": 0}, r"lease_renew_interval must be a positive number of seconds"),
    ({"lease_renew_interval": "5"}, r"lease_renew_interval must be a positive number of seconds"),
]


@pytest.mark.parametrize(
    ("options", "message"), TASK_OPTION_ERRORS, ids=[repr(o) for o, _ in TASK_OPTION_ERRORS]
)
def test_task_options_are_refused_at_registration(options: dict[str, Any], message: str) -> None:
    from celery_lease import LeasedTask

    app = _app(lease_store_url=SQLITE)
    with pytest.raises(LeaseConfigError, match=rf"task 'bad.opts': {message}"):

        @app.task(base=LeasedTask, bind=True, name="bad.opts", shared=False, **options)
        def opts(self: Any, key: str) -> str:
            return key

        app.finalize(auto=True)


# --------------------------------------------------------------------------
# keys of any content and length, on every store
# --------------------------------------------------------------------------

UNICODE_KEYS = {
    "emoji": "payment-😀🔒-42",
    "rtl+combining": "مفتاح-עִבְרִית-e\u0301\u0308",
    "cjk": "支付安全套件-四十二",
    "nul": "before\x00after",
    "lone surrogate": "half-\ud83d-pair",
    "newline+tab": "line1\nline2\tcol",
    "10k ascii": "k" * 10_000,
    "10k emoji": "😀" * 10_000,
    "201 chars": "z" * (MAX_KEY_LENGTH + 1),
    "200 chars": "y" * MAX_KEY_LENGTH,
}

#: Lua and SQL metacharacters; each must be nothing but part of a key.
META_KEYS = [
    "quote'single",
    'quote"double',
    "percent%sign",
    "under_score",
    "star*glob",
    "ques?tion",
    "brack[et]s",
    "brace{tag}",
    "}close{open",
    "{",
    "back\\slash",
    "trailing\\",
    "lua]]..redis.call('FLUSHALL')..[[",
    "lua%s%d%%",
    "x'; DROP TABLE celery_lease_leases; --",
    'x"); DELETE FROM celery_lease_results; --',
    "/* comment */",
    "$1 ? :key %(key)s {key}",
]


@pytest.fixture(params=STORE_KINDS)
def kind_store(
    request: pytest.FixtureRequest, pg_url: str
) -> Iterator[tuple[str, LeaseStore, ResultTable]]:
    kind = request.param
    url = store_url(request, kind)
    store = LeaseStore.from_url(url)
    if kind == "redis":
        celery_lease.migrate(pg_url)
        table = ResultTable(pg_url, store)
    else:
        table = ResultTable(url, store)
    yield kind, store, table
    store.close()


def _ns() -> str:
    return f"bad-{uuid.uuid4().hex[:8]}-"


def test_keys_of_any_unicode_and_length_work_on_every_store(
    kind_store: tuple[str, LeaseStore, ResultTable],
) -> None:
    _, store, table = kind_store
    ns = _ns()
    held = {}
    for name, raw in UNICODE_KEYS.items():
        key = ns + raw
        lease = store.claim(key, ttl=30, owner_id=f"o-{name}")
        assert lease is not None, name
        assert lease.key == shorten(key) and len(lease.key) <= MAX_KEY_LENGTH
        if len(key) <= MAX_KEY_LENGTH and not has_unstorable(key):
            assert lease.key == key, f"{name}: a storable key is kept as given"
        assert store.claim(key, ttl=30) is None, f"{name}: the same key conflicts"
        record = store.inspect(key)
        assert record is not None and record.live and record.owner_id == f"o-{name}", name
        assert store.renew(lease), name
        held[name] = lease
    # all distinct (shortening never merges two keys), and listed under their prefix
    assert len({lease.key for lease in held.values()}) == len(UNICODE_KEYS)
    assert {r.key for r in store.list(prefix=ns)} == {lease.key for lease in held.values()}
    assert [r.key for r in store.list(prefix=ns + "payment-😀")] == [held["emoji"].key]
    for name, lease in held.items():
        accepted = table.commit(lease, {"name": name})
        assert table.accepted(ns + UNICODE_KEYS[name]) == accepted, name
        assert table.get(ns + UNICODE_KEYS[name], lease.token) == accepted
        assert store.release(lease) is True  # idempotent after the commit's release
    assert store.list(prefix=ns) == []


def test_lua_and_sql_metacharacters_are_only_data(
    kind_store: tuple[str, LeaseStore, ResultTable],
) -> None:
    _, store, table = kind_store
    ns = _ns()
    sentinel = store.claim(ns + "sentinel", ttl=30, owner_id="sentinel")
    assert sentinel is not None
    leases = {}
    for raw in META_KEYS:
        key = ns + raw
        lease = store.claim(key, ttl=30, owner_id=f"owner {raw}")
        assert lease is not None and lease.key == key, raw
        record = store.inspect(key)
        assert record is not None and record.key == key and record.owner_id == f"owner {raw}"
        assert record.token == lease.token
        assert [r.key for r in store.list(prefix=key)] == [key], raw
        leases[raw] = lease
    listed = {r.key for r in store.list(prefix=ns)}
    assert listed == {ns + raw for raw in META_KEYS} | {ns + "sentinel"}
    for raw, lease in leases.items():
        accepted = table.commit(lease, {"raw": raw})
        assert accepted.key == ns + raw and table.accepted(ns + raw) == accepted
    # nothing leaked: the sentinel still holds, every table still answers
    record = store.inspect(ns + "sentinel")
    assert record is not None and record.live and record.owner_id == "sentinel"
    assert store.renew(sentinel)
    assert {r.key for r in store.list(prefix=ns)} == {ns + "sentinel"}
    assert table.accepted(ns + "x'; DROP TABLE celery_lease_leases; --") is not None
    # evicting a metacharacter key touches only that key
    victim = ns + "star*glob"
    again = store.claim(victim, ttl=30)
    assert again is not None
    assert store.evict(victim) is not None
    assert store.inspect(ns + "sentinel").live  # type: ignore[union-attr]


PREFIX_KEYS = ["a%b", "aXb", "a_b", "a*b", "a?b", "a[b]", "ab]", "a\\b", "A%b", "a%%b", "a"]


@pytest.mark.parametrize(
    ("prefix", "matches"),
    [
        ("a%", {"a%b", "a%%b"}),
        ("a_", {"a_b"}),
        ("a*", {"a*b"}),
        ("a?", {"a?b"}),
        ("a[", {"a[b]"}),
        ("a\\", {"a\\b"}),
        ("A", {"A%b"}),
        ("a%%", {"a%%b"}),
        ("a", set(PREFIX_KEYS) - {"A%b"}),
        ("", set(PREFIX_KEYS)),
        ("b\x00", set()),
    ],
)
def test_list_prefix_matches_literally(
    kind_store: tuple[str, LeaseStore, ResultTable], prefix: str, matches: set[str]
) -> None:
    _, store, _ = kind_store
    ns = _ns()
    for raw in PREFIX_KEYS:
        assert store.claim(ns + raw, ttl=30) is not None
    got = {r.key[len(ns) :] for r in store.list(prefix=ns + prefix)}
    assert got == matches


def test_keys_of_any_content_end_to_end_through_a_task_on_every_store(
    kind_store: tuple[str, LeaseStore, ResultTable], tmp_path: Path
) -> None:
    """``task.apply()`` runs the whole LeasedTask path in this process: keys derived from
    the arguments, claim, prepare, renew, fenced commit, ``task.accepted()``."""
    _, store, table = kind_store
    env = {
        "CL_BROKER": "memory://",
        "CL_BACKEND": "cache+memory://",
        "CL_STORE": store.url,
        "CL_RESULTS": table.url,
        "CL_SETTINGS": json.dumps({"lease_send_events": False}),
    }
    app, tasks = build_tenant(env)
    ns = _ns()
    try:
        for raw in [*UNICODE_KEYS.values(), *META_KEYS]:
            key = ns + raw
            result = tasks.keyed.apply(args=(key,))
            assert result.state == "SUCCESS", (raw[:40], result.result)
            digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
            assert result.result["sha"] == digest
            assert result.result["lease_key"] == shorten(key)
            accepted = tasks.keyed.accepted(key)
            assert accepted is not None and accepted.value == result.result, raw[:40]
    finally:
        app.close()


# --------------------------------------------------------------------------
# worker level
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"lease_store_url": "redis://127.0.0.1:6379/one"},
            "lease_store_url: the path of redis://127.0.0.1:6379/one must be a Redis database",
        ),
        (
            {
                "lease_store_url": "redis://127.0.0.1:1/0",
                "lease_store_options": {"ssl_ca_cert": "x"},
            },
            "unexpected keyword argument 'ssl_ca_cert'",
        ),
    ],
)
def test_worker_refuses_to_start_naming_the_setting(
    settings: dict[str, Any], expected: str, fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    settings = dict(settings)
    env = {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": settings.pop("lease_store_url"),
        "CL_RESULTS": f"sqlite:///{tmp_path / 'r.sqlite3'}",
        "CL_SETTINGS": json.dumps(settings),
    }
    code, log = Worker("bad", env, tmp_path, app="tests.apps.tenantapp").run_to_exit(timeout=60)
    assert code != 0 and " ready." not in log, log[-3000:]
    assert "LeaseConfigError" in log and expected in log, log[-3000:]


def test_a_real_worker_runs_tasks_with_any_key(
    make_redis_server: Any, pg_url: str, tmp_path: Path
) -> None:
    celery_lease.migrate(pg_url)
    redis: RedisServer = make_redis_server(appendonly=False)
    c = Cluster(
        tmp_path,
        broker=redis.url(0),
        backend=redis.url(1),
        store_url=redis.url(2),
        results_url=pg_url,
        ttl=3.0,
    )
    try:
        c.worker("keys").start()
        ns = _ns()
        raws = [UNICODE_KEYS[n] for n in ("emoji", "nul", "10k emoji", "lone surrogate")]
        raws += ["lua]]..redis.call('FLUSHALL')..[[", "x'; DROP TABLE celery_lease_leases; --"]
        sent = [(ns + raw, c.tasks.keyed.delay(ns + raw)) for raw in raws]
        for key, res in sent:
            value = res.get(timeout=30)
            assert value["sha"] == hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
            assert value["lease_key"] == shorten(key)
            accepted = c.tasks.keyed.accepted(key)
            assert accepted is not None and accepted.task_id == res.id
        assert c.workers[0].alive()
    finally:
        c.close()


def test_a_renew_interval_too_long_for_the_apps_ttl(
    fresh_redis: Callable[[], str], tmp_path: Path
) -> None:
    """Only with the app's TTL (3 s) is the task's interval (20 s) wrong: the worker refuses
    to start naming both; a direct ``apply()`` fails before claiming (the key stays free)."""
    env = {
        "CL_BROKER": fresh_redis(),
        "CL_BACKEND": fresh_redis(),
        "CL_STORE": f"sqlite:///{tmp_path / 'l.sqlite3'}",
    }
    code, log = Worker("badrenew", env, tmp_path, app="tests.apps.badrenewapp").run_to_exit(60)
    assert code != 0 and " ready." not in log, log[-3000:]
    message = (
        "task 'badrenewapp.suite': lease_renew_interval (20) must be at most half the TTL (3.0)"
    )
    assert message in log, log[-3000:]

    from celery_lease import LeasedTask

    url = f"sqlite:///{tmp_path / 'apply.sqlite3'}"
    app = _app(lease_store_url=url, lease_ttl=3.0, lease_send_events=False)
    app.conf.update(broker_url="memory://", result_backend="cache+memory://")

    @app.task(
        base=LeasedTask,
        bind=True,
        shared=False,
        name="badrenewapp.suite",
        lease_key="{key}",
        lease_renew_interval=20,
    )
    def suite(self: Any, key: str) -> str:
        return key

    result = suite.apply(args=("renew-key",))
    assert result.state == "FAILURE" and isinstance(result.result, LeaseConfigError)
    assert message in str(result.result)
    store = LeaseStore.from_url(url)
    assert store.inspect("renew-key") is None, "the bad task claimed the key"
    store.close()
