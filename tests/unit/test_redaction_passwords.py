"""No password drawn from every character a password may hold is ever printed.

The redaction tests before this one drew friendly passwords (no quotes, no
spaces), and a masking by character class let ``redis://:pa'S3cr3tPW@h``
through whole: in the store's ``repr``, its ``StoreUnavailable`` (and so event
reasons and logs) and config errors. Here passwords are drawn over the RFC 3986
user-info alphabet plus the awkward ones (``@ : / ? # ; ' "``, spaces,
percent-encodings, unicode), planted in every URL form celery-lease accepts,
and each output is searched for them. A password is "printed" if it appears
whole; it is made at least 6 characters so the search is not fooled by a
trivial substring.
"""

from __future__ import annotations

import string
import traceback
from collections.abc import Callable

import pytest
from celery import Celery
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celery_lease import LeaseConfigError, LeaseError, LeaseStore
from celery_lease.config import config
from celery_lease.redaction import MASK, redact
from celery_lease.urls import redact_url
from tests.servers import free_port

#: RFC 3986 user info: unreserved, sub-delims, ':' and percent-encodings.
_RFC3986 = string.ascii_letters + string.digits + "-._~" + "!$&'()*+,;=" + ":"
#: What clients accept unencoded all the same, and what a user pastes.
_AWKWARD = "@/?#'\" %é€😀\\[]{}<>|^`"
_CHARS = st.one_of(
    st.sampled_from(_RFC3986 + _AWKWARD),
    st.sampled_from(["%40", "%3A", "%2F", "%20", "%25", "%27"]),
)
#: Passwords a whitespace ends in free text (a message quoting a raw URL).
_NO_SPACE = [c for c in _RFC3986 + _AWKWARD if not c.isspace()]


def passwords(chars: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    # "Zq" first: never a part of the rest of a URL, so a hit is the password.
    return st.lists(chars, min_size=4, max_size=16).map(lambda cs: "Zq" + "".join(cs))


#: Every URL form the built-in stores accept with a password (urls.py,
#: stores/registry.py); ``{pw}`` is the password, ``{port}`` a closed port.
URL_FORMS = {
    "redis": "redis://user:{pw}@127.0.0.1:{port}/0",
    "redis-no-user": "redis://:{pw}@127.0.0.1:{port}/0",
    "rediss": "rediss://user:{pw}@127.0.0.1:{port}/0",
    "redis-query": "redis://127.0.0.1:{port}/0?password={pw}",
    "sentinel": "sentinel://:{pw}@127.0.0.1:{port};sentinel://:{pw}@127.0.0.2:{port}/0",
    "redis+cluster": "redis+cluster://u:{pw}@127.0.0.1:{port},127.0.0.2:{port}/0",
    "rediss+cluster": "rediss+cluster://u:{pw}@127.0.0.1:{port}",
    "postgresql": "postgresql://user:{pw}@127.0.0.1:{port}/db",
    "postgres": "postgres://user:{pw}@127.0.0.1:{port}/db",
    "postgresql+psycopg": "postgresql+psycopg://user:{pw}@127.0.0.1:{port}/db",
    "postgresql-query": "postgresql+psycopg://user@127.0.0.1:{port}/db?password={pw}",
    "etcd": "etcd://user:{pw}@127.0.0.1:{port}",
    "etcds": "etcds://user:{pw}@127.0.0.1:{port},127.0.0.2:{port}",
}


def assert_hidden(pw: str, what: str, text: str) -> None:
    assert pw not in text, f"{what} shows the password {pw!r}:\n{text[-2000:]}"


def outputs_of(e: BaseException) -> list[str]:
    return [str(e), repr(e), "".join(traceback.format_exception(e))]


@settings(max_examples=400, deadline=None)
@given(form=st.sampled_from(sorted(URL_FORMS)), pw=passwords(_CHARS))
@example(form="redis-no-user", pw="pa'S3cr3tPW")  # the reviewer's
@example(form="postgresql+psycopg", pw="pa'S3cr3tPW")
@example(form="redis", pw='x"S3cr3tPW')
def test_redact_url_hides_any_password_in_every_form(form: str, pw: str) -> None:
    url = URL_FORMS[form].format(pw=pw, port=6379)
    shown = redact_url(url)
    assert_hidden(pw, "redact_url", shown)
    assert MASK in shown and "127.0.0.1" in shown, shown


@settings(max_examples=400, deadline=None)
@given(
    form=st.sampled_from(sorted(URL_FORMS)),
    pw=passwords(st.sampled_from(_NO_SPACE)),
    around=st.sampled_from(["{}", "Redis {} unavailable: refused", "({!r})", "url={}", "'{}'"]),
)
@example(form="redis-no-user", pw="pa'S3cr3tPW", around="{}")
def test_redact_hides_a_password_in_a_message(form: str, pw: str, around: str) -> None:
    """In free text a URL ends at whitespace; any other character may be the password's."""
    shown = redact(around.format(URL_FORMS[form].format(pw=pw, port=6379)))
    assert_hidden(pw, "redact", shown)


# -- a store of every scheme, its server unreachable ------------------------------

_STORE_FORMS = sorted(set(URL_FORMS) - {"etcd", "etcds"})  # etcd refuses a password


def _fails(op: Callable[[], object]) -> BaseException | None:
    try:
        op()
    except LeaseError as e:
        return e
    return None


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(form=st.sampled_from(_STORE_FORMS), pw=passwords(_CHARS))
@example(form="redis-no-user", pw="pa'S3cr3tPW")
@example(form="redis", pw='x"S3cr3tPW')
@example(form="postgresql+psycopg", pw="pa'S3cr3tPW")
# SQLAlchemy reads the text after a password's "@" as the port: its ValueError
# must not escape LeaseStore.from_url (test_redaction_url_parsers.py tries such
# passwords in every form, deterministically).
@example(form="postgres", pw="Zqaa@:")
@example(form="postgresql-query", pw="Zqaa@:")
def test_a_store_that_is_down_hides_any_password(form: str, pw: str) -> None:
    url = URL_FORMS[form].format(pw=pw, port=free_port())
    try:
        store = LeaseStore.from_url(url, **_FAST.get(form.split("-")[0], {}))
    except LeaseError as e:  # a password the client cannot read: refused, not shown
        for text in outputs_of(e):
            assert_hidden(pw, "the config error", text)
        return
    try:
        assert_hidden(pw, "repr(store)", repr(store))
        e = _fails(lambda: store.claim("k", owner_id="o", ttl=5))
        assert e is not None, "the claim reached no server, yet did not fail"
        for text in outputs_of(e):
            assert_hidden(pw, "the store's error", text)
    finally:
        store.close()


#: Client options that make an unreachable server fail at once.
_FAST: dict[str, dict[str, object]] = {
    "sentinel": {"socket_timeout": 0.5},
    "redis+cluster": {"socket_timeout": 0.5},
    "rediss+cluster": {"socket_timeout": 0.5},
}


# -- config errors ------------------------------------------------------------------


def _config_error(conf: dict[str, object]) -> LeaseConfigError:
    app = Celery("redaction", set_as_current=False)
    app.conf.update(conf)
    with pytest.raises(LeaseConfigError) as info:
        config(app)
    return info.value


@settings(max_examples=100, deadline=None)
@given(form=st.sampled_from(sorted(URL_FORMS)), pw=passwords(_CHARS))
# Found by this test in CI: a Sentinel list without its first scheme, a space in
# the password, and the text before the second "://" was quoted as the scheme.
@example(form="sentinel", pw="Zqaaa ")
# urllib refuses a "[" that opens no IPv6 host with a ValueError of its own.
@example(form="postgres", pw="Zqaaa[")
def test_config_errors_hide_any_password(form: str, pw: str) -> None:
    url = URL_FORMS[form].format(pw=pw, port=6379)
    for conf in (
        {"lease_store_url": url, "lease_ttl": "30"},  # refused for the TTL, quoting none
        {"lease_store_url": url.replace("127.0.0.1", "127.0.0.1:notaport", 1)},
        {"lease_store_url": url.split("://", 1)[1]},  # no scheme
        {"lease_store_url": [url]},
        {"lease_result_url": url} if "postgres" not in form else {"lease_result_url": 5},
        {"lease_store_options": [("password", pw)]},
        {"lease_store_options": {"password": pw, "no_such_option": 1}},
        {"lease_store_options": {"ssl_password": pw, "ssl_keyfile_password": pw, "bad": 1}},
    ):
        try:
            err = _config_error({"lease_store_url": "redis://127.0.0.1:6379/0", **conf})
        except pytest.fail.Exception:
            continue  # the setting was accepted: nothing printed
        for text in outputs_of(err):
            assert_hidden(pw, f"the config error for {sorted(conf)}", text)


@pytest.mark.parametrize(
    "text",
    [
        "{'ssl_password': 'S3cr3tPW'}",
        "{'ssl_keyfile_password': 'S3cr3tPW'}",
        "ssl_password=S3cr3tPW",
        "PGPASSWORD=S3cr3tPW",
        "{'sentinel_kwargs': {'password': 'S3cr3tPW'}}",
        "{'client_secret': 'S3cr3tPW', 'api_key': 'S3cr3tPW'}",
        "?sslpassword=S3cr3tPW&x=1",
        "password=pa'S3cr3tPW",
    ],
)
def test_secret_option_names_are_matched_as_a_class(text: str) -> None:
    assert "S3cr3tPW" not in redact(text), redact(text)
