"""One redaction for every message, ``repr``, log record, event and CLI line.

Secrets reach celery-lease in URLs (``redis://user:pw@host``,
``?password=...``, which redis-py and libpq both accept) and in client options
(``{'password': ...}``). :func:`redact` masks all three forms wherever they
appear in a text, so an error that quotes a URL or a driver message is safe
to print, log, or send as an event ``reason``. TLS key files are only ever
named by path and handed to the client, never read here.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "redact"]

MASK = "***"

#: Query parameters and option names whose values are secrets.
_SECRET_NAMES = (
    r"(?:ssl)?pass(?:word|wd|phrase)?|pwd|secret|client_secret|token|access_token|"
    r"auth_token|api_?key|credentials?"
)

#: ``user:password@`` after a scheme, or at the start of a word (a URL given
#: without its scheme, as a misconfigured setting may be). Without a scheme
#: the "password" may not start with ``//``: that is a scheme's own
#: ``://`` before a user with no password (``postgresql://postgres@host``).
_USERINFO = re.compile(
    r"(?P<pre>(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)|(?<![^\s'\"(=,\[]))"
    # Without a scheme, a "password" starting with ``//`` is a URL's own
    # ``scheme://user@host`` (a user, no password): left whole.
    # The password runs to the *last* ``@`` (as urllib splits it): an ``@`` in it
    # must not leave its tail shown.
    r"(?P<user>[^\s:/@'\"]*):(?(scheme)|(?!//))(?P<pw>[^\s'\"]+)@"
)
#: ``password=...`` in a query string or an option list.
_PARAM = re.compile(
    rf"(?P<name>(?<![A-Za-z0-9_])(?:{_SECRET_NAMES}))=(?P<value>[^&\s'\",;)\]}}]*)",
    re.IGNORECASE,
)
#: ``'password': '...'`` in the repr of a dict of options.
_ITEM = re.compile(
    rf"(?P<name>['\"](?:{_SECRET_NAMES})['\"]\s*:\s*)(?P<q>['\"]?)(?P<value>.*?)(?P=q)(?=[,}}\s])",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with every password-like value replaced by ``***``."""
    if ":" not in text and "=" not in text:
        return text  # the common case (a key, a reason): nothing to look for
    text = _USERINFO.sub(lambda m: f"{m['pre'] or ''}{m['user']}:{MASK}@", text)
    text = _PARAM.sub(lambda m: f"{m['name']}={MASK}", text)
    return _ITEM.sub(lambda m: f"{m['name']}{m['q']}{MASK}{m['q']}", text)
