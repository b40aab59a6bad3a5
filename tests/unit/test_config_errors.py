"""Bad ``lease_*`` settings, task options and key templates: every error message,
in process (plain Celery app objects, nothing executed, no servers).

``Config.from_app``, the task options checked at registration and at worker
start (``check_tasks``), and ``KeySpec``. That a real worker stops on them at
start: tests/acceptance/test_settings.py.
"""

from __future__ import annotations

import datetime
import json
import warnings
from typing import Any

import pytest
from celery import Celery

from celery_lease import LeaseConfigError
from celery_lease.config import DEFAULT_SQLITE_URL, Config
from celery_lease.keys import KeySpec, scoped
from celery_lease.task import LeasedTask

# --------------------------------------------------------------------------
# Config.from_app, in process
# --------------------------------------------------------------------------


def _app(**settings: Any) -> Celery:
    app = Celery("settings-test", set_as_current=False)
    app.conf.update(settings)
    return app


def test_defaults() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lease_result_url unset: a logged warning only
        cfg = Config.from_app(_app())
    assert cfg.store_url == DEFAULT_SQLITE_URL
    assert cfg.result_url == DEFAULT_SQLITE_URL
    assert cfg.ttl == 30.0
    assert cfg.renew_interval is None  # TTL / 3 per lease
    assert (cfg.mode, cfg.on_conflict, cfg.on_duplicate) == ("exclusive", "defer", "reject")
    assert cfg.key_prefix == "celery-lease"
    assert cfg.send_events is True
    assert cfg.clock_drift is None


def test_sql_store_is_the_default_result_database() -> None:
    cfg = Config.from_app(_app(lease_store_url="postgresql+psycopg://db/proj"))
    assert cfg.result_url == "postgresql+psycopg://db/proj"


def test_a_lease_backend_is_the_default_result_database(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``result_backend = "lease+X"`` and no ``lease_result_url``: the results go to
    X, so a leased task's accepted row and its SUCCESS share one transaction."""
    with caplog.at_level("WARNING", logger="celery_lease.config"):
        cfg = Config.from_app(
            _app(
                result_backend="lease+postgresql+psycopg://db/proj",
                lease_store_url="redis://127.0.0.1:6379/1",
            )
        )
    assert cfg.result_url == "postgresql+psycopg://db/proj"
    assert "lease_result_url is not set" not in caplog.text  # no embedded SQLite file
    # Before an SQL store's own database too; Celery(backend=...) reads the same.
    app = Celery("settings-test", backend="lease+sqlite:///states.sqlite3", set_as_current=False)
    app.conf.lease_store_url = "postgresql+psycopg://db/leases"
    assert Config.from_app(app).result_url == "sqlite:///states.sqlite3"
    # lease_result_url set: it wins (and the backend's SUCCESS is a write of its own).
    cfg = Config.from_app(
        _app(
            result_backend="lease+postgresql+psycopg://db/states",
            lease_result_url="postgresql+psycopg://db/results",
        )
    )
    assert cfg.result_url == "postgresql+psycopg://db/results"
    # Any other backend: as before.
    cfg = Config.from_app(
        _app(result_backend="redis://127.0.0.1:6379/2", lease_store_url="postgresql+psycopg://db/p")
    )
    assert cfg.result_url == "postgresql+psycopg://db/p"


def test_good_settings_are_read() -> None:
    cfg = Config.from_app(
        _app(
            lease_store_url="redis://127.0.0.1:6379/1",
            lease_result_url="sqlite:///x.sqlite3",
            lease_ttl=12,
            lease_renew_interval=4,
            lease_mode="once",
            lease_on_conflict="wait",
            lease_on_duplicate="return",
            lease_clock_drift=0.5,
            lease_result_expires=datetime.timedelta(days=2),
            lease_metrics_port=9108,
        )
    )
    assert (cfg.ttl, cfg.renew_interval, cfg.clock_drift) == (12.0, 4.0, 0.5)
    assert (cfg.mode, cfg.on_conflict, cfg.on_duplicate) == ("once", "wait", "return")
    assert cfg.result_expires == 2 * 86400
    assert cfg.metrics_port == 9108


CONFIG_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"lease_ttl": -1}, r"lease_ttl must be greater than 0, got -1"),
    ({"lease_ttl": 0}, r"lease_ttl must be greater than 0, got 0"),
    ({"lease_ttl": "30"}, r"lease_ttl must be a number of seconds, got '30'"),
    ({"lease_ttl": True}, r"lease_ttl must be a number of seconds, got True"),
    ({"lease_mode": "sometimes"}, r"lease_mode must be one of exclusive, once; got 'sometimes'"),
    (
        {"lease_on_conflict": "queue"},
        r"lease_on_conflict must be one of defer, reject, wait; got 'queue'",
    ),
    (
        {"lease_on_duplicate": "ignore"},
        r"lease_on_duplicate must be one of reject, return; got 'ignore'",
    ),
    (
        {"lease_store_url": "mongodb://x"},
        r"lease_store_url: unknown URL scheme 'mongodb' in 'mongodb://x'; known: redis, rediss, "
        r"unix, sentinel, redis\+cluster, rediss\+cluster, sqlite, postgresql",
    ),
    (
        {"lease_store_url": "localhost:6379"},
        r"lease_store_url must be a URL such as redis://host:6379/1, postgresql\+psycopg://host/db "
        r"or sqlite:///path; got a string with no scheme://$",
    ),
    (
        {"lease_result_url": "redis://127.0.0.1/1"},
        r"lease_result_url must be a SQL database \(postgresql\+psycopg://\.\.\. or "
        r"sqlite:///\.\.\.\), got 'redis://127.0.0.1/1'",
    ),
    (
        {"lease_ttl": 3, "lease_renew_interval": 100},
        r"lease_renew_interval \(100.0\) must be at most half the TTL \(3.0\)",
    ),
    (
        {"lease_ttl": 3, "lease_renew_interval": 1.6},
        r"lease_renew_interval \(1.6\) must be at most half the TTL \(3.0\)",
    ),
    ({"lease_renew_interval": 0}, r"lease_renew_interval must be greater than 0, got 0"),
    (
        {"lease_ttl": 3, "lease_clock_drift": 99},
        r"lease_clock_drift must be >= 0 and below lease_ttl \(3.0\), got 99",
    ),
    ({"lease_clock_drift": -1}, r"lease_clock_drift must not be negative, got -1"),
    ({"lease_send_events": "yes"}, r"lease_send_events must be True or False, got 'yes'"),
    ({"lease_key_prefix": ""}, r"lease_key_prefix must be a non-empty string, got ''"),
    ({"lease_result_expires": -5}, r"lease_result_expires must be greater than 0, got -5"),
    ({"lease_metrics_port": 70000}, r"lease_metrics_port must be a TCP port number, got 70000"),
    (
        {"lease_metrics_addr": "http://0.0.0.0:9808"},
        r"lease_metrics_addr must be an IP address or host name to listen on .*'http://0.0.0.0:9808'",
    ),
    ({"lease_metrics_addr": ""}, r"lease_metrics_addr must be an IP address or host name"),
    ({"lease_store_options": "ssl"}, r"lease_store_options must be a dict of client options"),
    ({"lease_defer_max": 0}, r"lease_defer_max must be greater than 0, got 0"),
    ({"lease_wait_timeout": -1}, r"lease_wait_timeout must be greater than 0, got -1"),
]


@pytest.mark.parametrize(
    ("settings", "message"), CONFIG_ERRORS, ids=[json.dumps(s) for s, _ in CONFIG_ERRORS]
)
def test_config_error_names_the_setting(settings: dict[str, Any], message: str) -> None:
    base = {"lease_store_url": "sqlite:///x.sqlite3"}
    with pytest.raises(LeaseConfigError, match=message):
        Config.from_app(_app(**{**base, **settings}))


@pytest.mark.parametrize(
    ("typo", "right"),
    [
        ("lease_tll", "lease_ttl"),
        ("lease_on_conflicts", "lease_on_conflict"),
        ("LEASE_TTL", "lease_ttl"),
    ],
)
def test_typo_warns_naming_the_right_setting(typo: str, right: str) -> None:
    app = _app(lease_store_url="sqlite:///x.sqlite3", **{typo: 5})
    with pytest.warns(
        UserWarning, match=rf"unknown celery-lease setting '{typo}'; did you mean '{right}'\?"
    ):
        cfg = Config.from_app(app)
    assert cfg.ttl == 30.0  # the typo did not take effect


def test_unrelated_unknown_lease_setting_warns_without_a_guess() -> None:
    with pytest.warns(UserWarning, match=r"unknown celery-lease setting 'lease_zzzzzz'$"):
        Config.from_app(_app(lease_store_url="sqlite:///x.sqlite3", lease_zzzzzz=1))


# --------------------------------------------------------------------------
# task options, checked when the task is registered
# --------------------------------------------------------------------------


def _register(**options: Any) -> Any:
    app = _app(lease_store_url="sqlite:///x.sqlite3")

    # shared=False: a shared task would be registered again in every later app
    @app.task(base=LeasedTask, bind=True, name="proj.suite", shared=False, **options)
    def suite(self: Any, api_id: int, region: str = "eu") -> int:
        return api_id

    app.finalize(auto=True)
    return app.tasks["proj.suite"]


TASK_OPTION_ERRORS: list[tuple[dict[str, Any], str]] = [
    (
        {"lease_key": "payment-security-{api}"},
        r"task 'proj.suite': lease_key template names argument 'api', which the task does not "
        r"have \(its arguments: api_id, region\)",
    ),
    (
        {"lease_mode": "sometimes"},
        r"task 'proj.suite': lease_mode must be one of exclusive, once; got 'sometimes'",
    ),
    (
        {"lease_on_conflict": "queue"},
        r"task 'proj.suite': lease_on_conflict must be one of defer, reject, wait; got 'queue'",
    ),
    (
        {"lease_on_duplicate": "drop"},
        r"task 'proj.suite': lease_on_duplicate must be one of reject, return; got 'drop'",
    ),
    (
        {"lease_ttl": -1},
        r"task 'proj.suite': lease_ttl must be a positive number of seconds, got -1",
    ),
    (
        {"lease_ttl": 3, "lease_renew_interval": 2},
        r"task 'proj.suite': lease_renew_interval \(2\) must be at most half the TTL \(3\)",
    ),
    (
        {"lease_tenant": "tenant-{customer}"},
        r"task 'proj.suite': lease_key template names argument 'customer'",
    ),
]


@pytest.mark.parametrize(
    ("options", "message"), TASK_OPTION_ERRORS, ids=[json.dumps(o) for o, _ in TASK_OPTION_ERRORS]
)
def test_task_option_error_at_registration(options: dict[str, Any], message: str) -> None:
    with pytest.raises(LeaseConfigError, match=message):
        _register(**options)


@pytest.mark.parametrize(
    ("settings", "options", "message"),
    [
        (
            {"lease_ttl": 30},
            {"lease_renew_interval": 20},
            r"task 'proj.suite': lease_renew_interval \(20\) must be at most half the TTL "
            r"\(30.0\)",
        ),
        (
            {"lease_ttl": 30, "lease_clock_drift": 2.0},
            {"lease_ttl": 2},
            r"task 'proj.suite': lease_clock_drift \(2.0\) must be below the task's "
            r"lease_ttl \(2.0\)",
        ),
        (
            {"lease_ttl": 30, "lease_clock_drift": 7.0},
            {"lease_ttl": 10},
            r"task 'proj.suite': lease_renew_interval \(3.33333 = TTL / 3, the default\) does "
            r"not fit lease_ttl \(10\) less lease_clock_drift \(7\)",
        ),
    ],
)
def test_task_options_checked_against_the_app_settings_at_worker_start(
    settings: dict[str, Any], options: dict[str, Any], message: str
) -> None:
    from celery_lease.signals import check_tasks

    task = _register(**options)
    task.app.conf.update(settings)
    with pytest.raises(LeaseConfigError, match=message):
        check_tasks(task.app, Config.from_app(task.app))
    # The same options fit other settings.
    task.app.conf.update(lease_ttl=100, lease_clock_drift=None)
    check_tasks(task.app, Config.from_app(task.app))


def test_a_task_ttl_over_a_year_is_refused_when_the_task_is_bound() -> None:
    with pytest.raises(LeaseConfigError, match=r"task 'proj.suite': lease_ttl must be at most"):
        _register(lease_ttl=1e11).name  # noqa: B018 - binding the task runs its checks


def test_an_app_ttl_over_a_year_is_refused_for_every_task_at_worker_start() -> None:
    from celery_lease.signals import check_tasks

    task = _register()
    task.app.conf.lease_ttl = 1e11
    with pytest.raises(LeaseConfigError, match=r"lease_ttl"):
        check_tasks(task.app, Config.from_app(task.app))


def test_good_task_options_register() -> None:
    task = _register(lease_key="payment-security-{api_id}-{region}", lease_ttl=30)
    assert task.lease_keys_for((42,), {}) == ["payment-security-42-eu"]
    assert task.lease_keys_for((), {"api_id": 42, "region": "us"}) == ["payment-security-42-us"]


def test_publishing_a_call_that_does_not_fit_the_template_fails_before_sending() -> None:
    task = _register(lease_key="payment-security-{api_id}")
    # No broker is configured: the error comes from the key, before any publish.
    with pytest.raises(LeaseConfigError, match=r"task 'proj.suite': cannot derive its lease key"):
        task.apply_async(args=(1, "eu", "extra"))


# --------------------------------------------------------------------------
# KeySpec
# --------------------------------------------------------------------------


def _f(self: Any, api_id: int, region: str = "eu") -> None: ...


def _g(self: Any, **kwargs: Any) -> None: ...


KEYSPEC_ERRORS: list[tuple[Any, str]] = [
    (
        "payment-security-{api}",
        r"task 't': lease_key template names argument 'api', which the task does not have "
        r"\(its arguments: api_id, region\)",
    ),
    ("payment-security-{0}", r"task 't': lease_key 'payment-security-\{0\}' must name arguments"),
    ("payment-security-{}", r"task 't': lease_key 'payment-security-\{\}' must name arguments"),
    (
        "payment-security-{api_id",
        r"task 't': lease_key 'payment-security-\{api_id' is not a valid format string",
    ),
    (42, r"task 't': lease_key must be a format string or a callable, got 42"),
]


@pytest.mark.parametrize(
    ("template", "message"), KEYSPEC_ERRORS, ids=[repr(t) for t, _ in KEYSPEC_ERRORS]
)
def test_keyspec_rejects_a_bad_template(template: Any, message: str) -> None:
    with pytest.raises(LeaseConfigError, match=message):
        KeySpec("t", _f, template, bound=True)


def test_keyspec_call_errors_name_the_task() -> None:
    spec = KeySpec("t", _f, "payment-security-{api_id}", bound=True)
    assert spec.keys((42,), {}) == ["payment-security-42"]
    with pytest.raises(LeaseConfigError, match=r"task 't': cannot derive its lease key.*signature"):
        spec.keys((1, "eu", "extra"), {})
    with pytest.raises(LeaseConfigError, match=r"task 't': cannot derive its lease key"):
        spec.keys((), {"nope": 1})

    loose = KeySpec("t", _g, "payment-security-{api_id}", bound=True)  # **kwargs: checked per call
    assert loose.keys((), {"api_id": 7}) == ["payment-security-7"]
    with pytest.raises(
        LeaseConfigError,
        match=r"task 't': lease_key 'payment-security-\{api_id\}' names argument 'api_id', "
        r"which this call did not pass",
    ):
        loose.keys((), {"other": 1})

    attr = KeySpec("t", _f, "payment-security-{api_id.missing}", bound=True)
    with pytest.raises(LeaseConfigError, match=r"cannot be formatted from this call's arguments"):
        attr.keys((42,), {})


def test_keyspec_callable_and_default_key_errors() -> None:
    empty = KeySpec("t", _f, lambda api_id, region="eu": "", bound=True)
    with pytest.raises(LeaseConfigError, match=r"task 't': lease_key produced \[''\]; keys are"):
        empty.keys((1,), {})
    default = KeySpec("t", _f, None, bound=True)
    assert default.keys((1,), {}) == default.keys((), {"api_id": 1, "region": "eu"})
    with pytest.raises(
        LeaseConfigError, match=r"task 't': the default lease key hashes the arguments as JSON"
    ):
        default.keys((object(),), {})


def test_reserved_tenant_prefix() -> None:
    with pytest.raises(LeaseConfigError, match=r"keys starting with 't/' are reserved"):
        scoped("t/x", None)
    with pytest.raises(LeaseConfigError, match=r"a tenant is a non-empty string, got ''"):
        scoped("k", "")


@pytest.mark.parametrize(
    ("broker", "marks"),
    [
        ("redis://127.0.0.1:1/0", True),
        ("amqp://guest:guest@127.0.0.1:1//", True),
        ("filesystem://", False),  # requeues without the redelivered flag
        ("memory://", False),
        ("nosuchtransport://x", False),  # kombu: KeyError, no such transport
        ("sqs://", False),  # kombu: ImportError without boto3 (or a non-marking transport)
    ],
)
def test_which_brokers_mark_redeliveries(broker: str, marks: bool) -> None:
    """A first delivery skips the result-backend read only on transports that
    flag redelivered messages; a transport kombu cannot build here (unknown
    alias, missing library) counts as not flagging them (every copy is
    checked), and neither raises at task start. Nothing connects: resolving
    the transport class is all it takes."""
    from celery_lease.task import _broker_marks_redeliveries

    app = Celery("marks", broker=broker, set_as_current=False)
    try:
        assert _broker_marks_redeliveries(app) is marks
    finally:
        app.close()
