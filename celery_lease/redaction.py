"""One redaction for every message, ``repr``, log record, event and CLI line.

Secrets reach celery-lease in URLs (``redis://user:pw@host``,
``?password=...``, which redis-py and libpq both accept) and in client options
(``{'password': ...}``). :func:`redact` masks all three forms wherever they
appear in a text, so an error that quotes a URL or a driver message is safe
to print, log, or send as an event ``reason``. TLS key files are only ever
named by path and handed to the client, never read here.

User info is masked by *position*, not by the characters a password may
hold: a password may hold anything (``@ : / ? # ' "``, spaces, unicode) and
the clients disagree on where it ends (urllib, so redis-py, splits at the
last ``@`` of the authority; SQLAlchemy at the first ``@`` after the colon).
Everything from ``scheme://`` to the *last* ``@`` of the URL covers both.
In free text a URL's end is not known, so it is taken to end at whitespace;
:func:`redact_url`, for a whole URL, masks a password holding spaces too.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "redact", "redact_url"]

MASK = "***"

#: Option and query-parameter names whose values are secrets, as a class (any
#: name *holding* one of these words: ``ssl_password``, ``ssl_keyfile_password``,
#: ``sslpassword``, ``PGPASSWORD``, ``client_secret``, ``auth_token``), so a
#: driver's next option name needs no change here. Masking an option that is
#: not a secret costs a less useful message; missing one prints a secret.
_SECRET_NAME = (
    r"[A-Za-z0-9_.\-]*?(?:pass(?:word|wd|phrase)?|pwd|secret|token|credential|"
    r"api_?key|private_?key)[A-Za-z0-9_.\-]*"
)

_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*://"
#: A URL's scheme, not inside a longer word.
_URL_START = re.compile(rf"(?<![A-Za-z0-9+.\-]){_SCHEME}")
#: kombu's Sentinel list, ``sentinel://:pw@h1;sentinel://:pw@h2``: each part is
#: a URL of its own, with its own user info.
_NEXT_URL = re.compile(rf";\s*(?={_SCHEME})")
_SPACE = re.compile(r"\s")

#: ``user:password@`` at the start of a word, a URL given without its scheme
#: (as a misconfigured setting may be). Its "password" may not start with
#: ``//``: that is a scheme's own ``://`` before a user with no password
#: (``postgresql://postgres@host``). It runs to the last ``@`` of the word.
_BARE_USERINFO = re.compile(r"(?<![^\s'\"(=,\[])(?P<user>[^\s:/@'\"]*):(?!//)\S+@")

#: A closing quote, bracket or separator ends a ``password=`` value only where
#: the value's text ends (before whitespace, another closer or ``&``); inside
#: a value (``pa'ss``) it is part of the secret.
_CLOSERS = "'\"),;\\]}"
#: ``password=...`` in a query string or an option list.
_PARAM = re.compile(
    rf"(?P<name>(?<![A-Za-z0-9_.\-]){_SECRET_NAME})="
    rf"(?P<value>(?:[^&\s{_CLOSERS}]|[{_CLOSERS}](?=[^&\s{_CLOSERS}]))*)",
    re.IGNORECASE,
)
#: ``'password': '...'`` in the repr of a dict of options.
_ITEM = re.compile(
    rf"(?P<name>['\"]{_SECRET_NAME}['\"]\s*:\s*)(?P<q>['\"]?)(?P<value>.*?)(?P=q)(?=[,}}\s])",
    re.IGNORECASE,
)
#: A secret query parameter of a whole URL: its value runs to the next ``&``.
_QUERY_PARAM = re.compile(rf"(?<=[?&])(?P<name>{_SECRET_NAME})=[^&]*", re.IGNORECASE)


def _mask_userinfo(rest: str) -> str:
    """``rest`` (a URL after its ``scheme://``) with the password masked: from
    the first ``:`` of its user info to the last ``@``. A user with no password
    (``postgres@host``) is kept."""
    userinfo, at, tail = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return rest
    return f"{userinfo.partition(':')[0]}:{MASK}@{tail}"


def _mask_urls(text: str, whole: bool) -> str:
    """Every URL's user info in ``text`` masked; a URL ends at whitespace,
    unless ``whole`` (``text`` is one URL, or a ``;`` list of them)."""
    out: list[str] = []
    pos = 0
    while (start := _URL_START.search(text, pos)) is not None:
        space = None if whole else _SPACE.search(text, start.end())
        end = space.start() if space is not None else len(text)
        # One URL of a ';' list ends where the next begins.
        nxt = _NEXT_URL.search(text, start.end(), end)
        if nxt is not None:
            end = nxt.start()
        out.append(text[pos : start.end()])
        out.append(_mask_userinfo(text[start.end() : end]))
        pos = end
    out.append(text[pos:])
    return "".join(out)


def redact(text: str) -> str:
    """``text`` with every password-like value replaced by ``***``."""
    if ":" not in text and "=" not in text:
        return text  # the common case (a key, a reason): nothing to look for
    text = _mask_urls(text, whole=False)
    text = _BARE_USERINFO.sub(lambda m: f"{m['user']}:{MASK}@", text)
    text = _PARAM.sub(lambda m: f"{m['name']}={MASK}", text)
    return _ITEM.sub(lambda m: f"{m['name']}{m['q']}{MASK}{m['q']}", text)


def redact_url(url: str) -> str:
    """A whole URL (or kombu's ``;`` list of them) with its passwords masked,
    whatever they hold, spaces included; then :func:`redact` for the rest."""
    # The query first: a ``password=`` value holding ``@`` would otherwise be
    # read as the end of the user info, and its tail shown.
    url = _QUERY_PARAM.sub(lambda m: f"{m['name']}={MASK}", url)
    return redact(_mask_urls(url, whole=True))
