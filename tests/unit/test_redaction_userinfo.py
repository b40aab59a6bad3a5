"""``redact`` keeps URLs that carry a user but no password as they are.

A URL with a user and no password (``postgresql+psycopg://postgres@host/db``,
the usual form with trust or certificate authentication) was read as a
schemeless ``user:password@`` with the scheme as the user and ``//postgres``
as the password: logs showed ``postgresql+psycopg:***@host/db``, a URL that
names neither the scheme's ``//`` nor the user. Passwords are still masked in
every form.
"""

from __future__ import annotations

import pytest

from celery_lease.redaction import redact


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://postgres@127.0.0.1:5432/db",
        "redis://default@127.0.0.1:6379/0",
        "etcds://root@10.0.0.1:2379,10.0.0.2:2379",
        "the database postgresql://app@db.internal/leases has no tables",
    ],
)
def test_a_user_without_a_password_is_kept(url: str) -> None:
    assert redact(url) == url


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql+psycopg://postgres:s3cret@h/db", "postgresql+psycopg://postgres:***@h/db"),
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://u://s3cret@h", "redis://u:***@h"),  # a password starting with //
        ("user:s3cret@host:5432/db", "user:***@host:5432/db"),  # no scheme
    ],
)
def test_passwords_are_still_masked(text: str, shown: str) -> None:
    assert redact(text) == shown
