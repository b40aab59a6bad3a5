"""No *piece* of a password is printed when a URL parser misreads it.

A password with an unencoded ``@``, ``:``, ``/``, ``?``, ``#``, ``[`` or ``]`` is
split by the URL parsers: ``user:Zq@Kx7w:Tr9v@host:5432`` reads to SQLAlchemy as the host
``Kx7w`` and the port ``Tr9v@host:5432``; its ValueError quotes that "port",
and a driver that cannot resolve a misread host quotes the host: pieces of
the password. The property test of ``test_redaction_passwords.py`` draws such
passwords only now and then, and looks for the whole password only. Here
every URL form gets, deterministically, passwords that split at each of those
characters, through every entry point that takes a URL, and the outputs are
searched for each piece of four characters or more.
"""

from __future__ import annotations

import re

import pytest
from celery import Celery

import celery_lease
from celery_lease import LeaseStore
from celery_lease.config import config
from tests.servers import free_port

# (_fails: what a call raised, None if nothing; anything but a LeaseError fails the test)
from tests.unit.test_redaction_passwords import _FAST, URL_FORMS, _fails, outputs_of

#: Each splits at one or more URL delimiters into pieces a parser may quote.
PASSWORDS = [
    "Zq@Kx7w:Tr9v",  # SQLAlchemy: the port "Tr9v@host:port"
    "Zq:Kx7w@Tr9v",
    "Zq@Kx7w@Tr9v:Mp3s",
    "Zq#Kx7w@Tr9v:Mp3s",  # urllib: a fragment
    "Zq/Kx7w:Tr9v@Mp3s",  # a path
    "Zq?Kx7w@Tr9v:Mp3s",  # a query
    "Zq;Kx7w:Tr9v@Mp3s",  # a Sentinel list's separator
    "Zq[Kx7w@Tr9v:Mp3s",  # urllib: an IPv6 host that does not close
    "Zq]Kx7w@Tr9v:Mp3s",
]

_SQL_FORMS = sorted(f for f in URL_FORMS if f.startswith("postgres"))
_STORE_FORMS = sorted(URL_FORMS)  # etcd refuses a password: that error is searched too


def pieces(pw: str) -> list[str]:
    return [p for p in re.split(r"[@:/?#;\[\]]", pw) if len(p) >= 4]


def assert_no_piece(pw: str, what: str, e: BaseException | None) -> None:
    if e is None:
        return
    for text in outputs_of(e):
        for piece in pieces(pw):
            assert piece not in text, f"{what} shows {piece!r} of the password {pw!r}:\n{text}"


def test_the_pieces_are_what_a_parser_quotes() -> None:
    assert pieces("Zq@Kx7w:Tr9v") == ["Kx7w", "Tr9v"]
    assert all(len(pieces(pw)) >= 2 for pw in PASSWORDS)


@pytest.mark.parametrize("pw", PASSWORDS)
@pytest.mark.parametrize("form", _STORE_FORMS)
def test_a_store_from_a_misread_url_prints_no_piece(form: str, pw: str) -> None:
    url = URL_FORMS[form].format(pw=pw, port=free_port())
    stores: list[LeaseStore] = []

    def make_and_claim() -> None:
        store = LeaseStore.from_url(url, **_FAST.get(form, {}))
        stores.append(store)
        store.claim("k", owner_id="o", ttl=5)

    try:
        e = _fails(make_and_claim)
    finally:
        for store in stores:
            store.close()
    assert e is not None, "no server listens there, yet nothing failed"
    assert_no_piece(pw, "LeaseStore.from_url and a claim", e)


@pytest.mark.parametrize("pw", PASSWORDS)
@pytest.mark.parametrize("form", _SQL_FORMS)
def test_migrate_and_the_sql_settings_print_no_piece(form: str, pw: str) -> None:
    url = URL_FORMS[form].format(pw=pw, port=free_port())
    e = _fails(lambda: celery_lease.migrate(url))
    assert e is not None, "no server listens there, yet the migration did not fail"
    assert_no_piece(pw, "migrate()", e)
    for conf in (
        {"lease_store_url": url},
        {"lease_result_url": url},
        {"result_backend": "lease+" + url},
    ):
        app = Celery("redaction", set_as_current=False)
        app.conf.update(conf)
        assert_no_piece(pw, f"the settings {sorted(conf)}", _fails(lambda a=app: config(a)))
