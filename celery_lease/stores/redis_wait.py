"""The opt-in replication wait of the Redis stores: ``WAIT`` after a grant or renewal.

Redis replicates asynchronously: a master can acknowledge a grant and die
before any replica has it, and the replica promoted in its place then knows
nothing of the grant, so another worker is granted the same key while the
first still works. With ``wait_replicas=N`` (``lease_store_options``) every
claim and renewal is followed, in the same round trip, by ``WAIT N
wait_timeout_ms``; a grant or renewal that fewer than N replicas acknowledged
in time is *unreplicated*, and ``on_unreplicated`` decides:

* ``"release"`` (the default): the grant is released and the claim raises
  :class:`StoreUnavailable` (a task defers, as for any store outage); an
  unreplicated renewal raises it too, so the holder's local view of its lease
  is not extended past what the replicas were told (the renewer retries).
* ``"warn"``: the grant or renewal stands, and a warning is logged.

What WAIT does not do, in Redis's words: "WAIT does not make Redis a strongly
consistent store: while synchronous replication is part of a replicated state
machine, it is not the only thing needed." A write the replicas acknowledged can still be lost when
a replica that did not receive it is promoted (WAIT counts acknowledgements,
it does not choose the new master), and a write that timed out is not rolled
back on the master. It narrows the window in which a failover loses a grant;
it does not close it (docs/stores.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_lease.exceptions import LeaseConfigError

__all__ = ["ON_UNREPLICATED", "WAIT_OPTIONS", "WaitPolicy", "wait_policy"]

logger = logging.getLogger(__name__)

#: What to do with a grant or renewal fewer replicas acknowledged than asked.
ON_UNREPLICATED = ("release", "warn")
#: The store options this module reads (the client never sees them).
WAIT_OPTIONS = ("wait_replicas", "wait_timeout_ms", "on_unreplicated")
#: ``wait_timeout_ms`` when only ``wait_replicas`` is given.
DEFAULT_TIMEOUT_MS = 100


@dataclass(frozen=True)
class WaitPolicy:
    replicas: int
    timeout_ms: int
    release: bool  # on_unreplicated == "release"

    def describe(self, what: str, acked: int) -> str:
        return (
            f"{what} reached {acked} of {self.replicas} replicas within {self.timeout_ms} ms "
            "(lease_store_options['wait_replicas'])"
        )

    def warn(self, what: str, acked: int) -> None:
        logger.warning(
            "celery-lease: %s; kept (on_unreplicated='warn')",
            self.describe(what, acked),
            extra={"action": "unreplicated", "acked": acked, "wanted": self.replicas},
        )


def wait_policy(options: dict[str, Any]) -> WaitPolicy | None:
    """Take the wait options out of ``options``; None when no wait is asked for."""
    values: Mapping[str, Any] = {k: options.pop(k) for k in WAIT_OPTIONS if k in options}
    replicas = values.get("wait_replicas", 0)
    timeout = values.get("wait_timeout_ms", DEFAULT_TIMEOUT_MS)
    mode = values.get("on_unreplicated", "release")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise LeaseConfigError(
            f"lease_store_options['wait_replicas'] must be a whole number of replicas "
            f"(0: no wait), got {replicas!r}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        # WAIT with 0 blocks forever: a claim must never wait without bound.
        raise LeaseConfigError(
            f"lease_store_options['wait_timeout_ms'] must be a whole number of "
            f"milliseconds, at least 1, got {timeout!r}"
        )
    if mode not in ON_UNREPLICATED:
        raise LeaseConfigError(
            f"lease_store_options['on_unreplicated'] must be one of {ON_UNREPLICATED}, got {mode!r}"
        )
    if replicas == 0:
        if len(values) > 0 and "wait_replicas" not in values:
            raise LeaseConfigError(
                "lease_store_options: wait_timeout_ms and on_unreplicated take effect "
                "only with wait_replicas (the number of replicas a grant must reach)"
            )
        return None
    return WaitPolicy(replicas, timeout, mode == "release")
