"""``self.lease`` in a direct call ``task(...)``: a local lease, with no store.

A direct call runs the body in the caller, unleased, as Celery runs it without
retries or a result backend. So that a body written for the worker
(``self.lease.ensure()``, ``self.lease.token``, ``fencing.headers(self.lease)``)
also runs there, ``self.lease`` is then a :class:`LocalLease`:

* ``token`` is 0, below every token a store issues: ``fencing.guard`` takes
  it as the bare token 0, accepted only for a resource no leased execution
  has written (a direct call never overrides a real owner's writes);
* ``held`` is True, ``ensure()`` does nothing, ``renew()`` answers True,
  ``release()`` False (there is nothing to release);
* ``key`` / ``keys`` are the keys a leased execution of the same call would
  claim (tenant-scoped like them), worked out when first read;
* ``expires_at`` and ``remaining`` are infinite: nothing expires it.

Nothing is claimed anywhere, so a direct call proves nothing about leasing:
test that through a worker (``celery_lease.testing``).
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LocalLease"]


class LocalLease:
    """The stand-in lease of a direct call (see the module's doc)."""

    token = 0
    held = True
    lost_reason: str | None = None
    released = False
    renewals = 0
    expires_at = math.inf
    remaining = math.inf

    def __init__(self, task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        self.task = task
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self.owner_id = f"local:{socket.gethostname()}:{os.getpid()}"
        self._keys: tuple[str, tuple[str, ...]] | None = None

    def _key_pair(self) -> tuple[str, tuple[str, ...]]:
        if self._keys is None:
            from celery_lease.keys import scoped
            from celery_lease.stores.base import normalize_keys

            tenant = self.task.lease_tenant_for(self.args, self.kwargs)
            keys = [scoped(k, tenant) for k in self.task.lease_keys_for(self.args, self.kwargs)]
            self._keys = normalize_keys(keys)
        return self._keys

    @property
    def key(self) -> str:
        return self._key_pair()[0]

    @property
    def keys(self) -> tuple[str, ...]:
        return self._key_pair()[1]

    @property
    def ttl(self) -> float:
        return math.inf

    def ensure(self) -> None:
        """Nothing to check: a direct call is never fenced."""

    def renew(self) -> bool:
        return True

    def release(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<LocalLease of a direct call to {getattr(self.task, 'name', self.task)!r}>"
