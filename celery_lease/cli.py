"""``celery -A proj lease ...``: operators' commands, thin over library calls.

Registered through Celery's ``celery.commands`` entry point. Human-readable
tables by default (times in UTC, ISO 8601 with the zone), ``--json`` for
scripts; exit codes: 0 done, 1 an error (unreachable store, bad settings),
2 usage, 3 unknown key / nothing to do (``release`` of a key with no live
lease: nothing changed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from functools import wraps
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_lease.config import config
from celery_lease.exceptions import LeaseError
from celery_lease.keys import INTERNAL_PREFIX, scoped, user_key
from celery_lease.results import AcceptedResult, ResultTable
from celery_lease.scope import store_key
from celery_lease.stores.base import LeaseRecord, LeaseStore
from celery_lease.urls import redact_url

__all__ = ["lease"]

NOT_FOUND = 3


def _stores(ctx: click.Context) -> tuple[LeaseStore, ResultTable]:
    from celery_lease.runtime import runtime

    rt = runtime(ctx.obj.app)
    return rt.store, rt.results


def _errors(func: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except LeaseError as e:
            click.echo(f"Error: {e}", err=True)
            raise SystemExit(1) from e

    return wrapper


def _when(t: float | None, now: float | None = None) -> str:
    if t is None:
        return "-"
    stamp = datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")
    if now is not None:
        delta = t - now
        if delta >= 0:
            return f"{stamp} (in {delta:.1f}s)"
        return f"{stamp} ({-delta:.1f}s ago)"
    return stamp


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _record_json(r: LeaseRecord) -> dict[str, Any]:
    return {**asdict(r), "live": r.live, "remaining": r.remaining}


def _result_json(r: AcceptedResult) -> dict[str, Any]:
    return asdict(r)


tenant_option = click.option("--tenant", default=None, help="Tenant scope of the key.")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
stored_option = click.option(
    "--stored",
    is_flag=True,
    help="KEY is a store key exactly as `lease list` prints it (its tenant included).",
)


def _store_key(key: str, tenant: str | None, stored: bool) -> str:
    """KEY as stores hold it: a task's key (normalised as the task's own are, in
    --tenant's scope), or with --stored the store key verbatim."""
    if not stored:
        return store_key(key, tenant)[0]
    if tenant is not None:
        click.echo("Error: --stored takes the key with its tenant; drop --tenant", err=True)
        raise SystemExit(2)
    if key.startswith(INTERNAL_PREFIX):
        click.echo(f"Error: {key!r} is one of celery-lease's own records", err=True)
        raise SystemExit(2)
    return key


@click.group(name="lease")
def lease() -> None:
    """Inspect and manage celery-lease leases and accepted results."""


@lease.command(cls=CeleryCommand, name="list")
@click.option("--prefix", default="", help="Only keys starting with this.")
@click.option("--expired", is_flag=True, help="Include expired leases still on record.")
@tenant_option
@json_option
@click.pass_context
@_errors
def list_(
    ctx: click.Context, prefix: str, expired: bool, tenant: str | None, as_json: bool
) -> None:
    """Live leases (and expired ones with --expired); with --tenant, that tenant's only."""
    store, _ = _stores(ctx)
    if tenant is None:
        records = store.list(prefix, expired=expired)
    else:
        scoped(prefix or "-", tenant)  # refuses a tenant no scope could have
        tenant = user_key(tenant)  # as tasks record it (a long tenant is shortened)
        # The scope's prefix, and the record's own tenant: a shortened key's
        # prefix alone could be cut inside a long tenant's name.
        scope = f"t/{len(tenant)}:{tenant}/{prefix}"
        records = [r for r in store.list(scope, expired=expired) if r.tenant == tenant]
    if as_json:
        click.echo(json.dumps([_record_json(r) for r in records], indent=2))
        return
    if not records:
        click.echo("no leases")
        return
    click.echo(
        _table(
            ["KEY", "TOKEN", "OWNER", "TASK", "EXPIRES"],
            [
                (r.key, r.token, r.owner_id or "-", r.task_id or "-", _when(r.expires_at, r.now))
                for r in records
            ],
        )
    )


@lease.command(cls=CeleryCommand)
@click.argument("key")
@tenant_option
@stored_option
@json_option
@click.pass_context
@_errors
def show(ctx: click.Context, key: str, tenant: str | None, stored: bool, as_json: bool) -> None:
    """One key's lease record and fence: KEY as the task names it (with --tenant),
    or with --stored as `lease list` prints it."""
    store, _ = _stores(ctx)
    record = store.inspect(_store_key(key, tenant, stored))
    if record is None:
        click.echo(f"Error: no lease on record for {key!r}", err=True)
        raise SystemExit(NOT_FOUND)
    if as_json:
        click.echo(json.dumps(_record_json(record), indent=2))
        return
    state = "held" if record.live else "free"
    click.echo(
        _table(
            ["FIELD", "VALUE"],
            [
                ("key", record.key),
                ("state", state),
                ("token", record.token),
                ("owner", record.owner_id or "-"),
                ("task", record.task_id or "-"),
                ("task name", record.task_name or "-"),
                ("workflow", record.root_id or "-"),
                ("tenant", record.tenant or "-"),
                ("acquired", _when(record.acquired_at, record.now)),
                ("renewed", _when(record.renewed_at, record.now)),
                ("expires", _when(record.expires_at, record.now) if record.live else "-"),
            ],
        )
    )


@lease.command(cls=CeleryCommand)
@click.argument("key")
@tenant_option
@click.option("--limit", default=20, show_default=True, help="Newest N accepted results.")
@json_option
@click.pass_context
@_errors
def results(ctx: click.Context, key: str, tenant: str | None, limit: int, as_json: bool) -> None:
    """Accepted results for KEY, newest first."""
    _, table = _stores(ctx)
    full, tenant = store_key(key, tenant)
    rows = table.history(full, tenant, limit)
    if as_json:
        click.echo(json.dumps([_result_json(r) for r in rows], indent=2))
        return
    if not rows:
        click.echo(f"Error: no accepted result for {key!r}", err=True)
        raise SystemExit(NOT_FOUND)
    click.echo(
        _table(
            ["TOKEN", "TASK", "ACCEPTED", "RESULT"],
            [
                (r.token, r.task_id or "-", _when(r.accepted_at), json.dumps(r.value)[:60])
                for r in rows
            ],
        )
    )


@lease.command(cls=CeleryCommand)
@click.argument("key")
@tenant_option
@stored_option
@click.option("--force", is_flag=True, help="Required: evict whoever holds the key.")
@json_option
@click.pass_context
@_errors
def release(
    ctx: click.Context, key: str, tenant: str | None, stored: bool, force: bool, as_json: bool
) -> None:
    """Evict KEY's live lease and advance its fence.

    The evicted body is not stopped: it keeps running until it next checks
    its lease (a renewal, self.lease.ensure(), its commit), and its commit is
    then refused (FENCED), so its result is never accepted. A key with no
    live lease is left as it is (exit 3, nothing changed).
    """
    if not force:
        click.echo("Error: releasing someone else's lease needs --force", err=True)
        raise SystemExit(2)
    from celery_lease import metrics

    store, table = _stores(ctx)
    full = _store_key(key, tenant, stored)
    record = store.inspect(full)
    # By the token read: a lease granted after the read is never the one evicted,
    # and a key with no live lease keeps its fence (an evict without a token
    # would advance it anyway).
    evicted = store.evict(full, token=record.token) if record and record.live else None
    if evicted is None:
        if as_json:
            click.echo(json.dumps({"key": key, "evicted": None, "fence": None}))
        else:
            click.echo(f"{key}: no live lease; nothing changed")
        raise SystemExit(NOT_FOUND)
    fence = store.fence_token(full)
    table.raise_fence(full, fence)
    metrics.force_releases.inc()
    if as_json:
        click.echo(json.dumps({"key": key, "evicted": _record_json(evicted), "fence": fence}))
    else:
        click.echo(
            f"{key}: evicted {evicted.owner_id} (token {evicted.token}, task "
            f"{evicted.task_id or '-'}); fence advanced to {fence}. The evicted body runs "
            "on until it next checks its lease; its commit will be refused"
        )


@lease.command(cls=CeleryCommand)
@click.pass_context
@_errors
def migrate(ctx: click.Context) -> None:
    """Create or upgrade celery-lease's tables (leases, results, fences, the
    lease+ result backend's records)."""
    from celery_lease.sql.migrate import migrate as run_migrations
    from celery_lease.startup import databases

    for url in databases(ctx.obj.app, config(ctx.obj.app)):
        run_migrations(url)
        click.echo(f"migrated {redact_url(url)}")


@lease.command(cls=CeleryCommand)
@click.option(
    "--lease-grace",
    default=3600.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Delete lease rows expired for longer than this many seconds (>= 0).",
)
@json_option
@click.pass_context
@_errors
def sweep(ctx: click.Context, lease_grace: float, as_json: bool) -> None:
    """Delete results past lease_result_expires and long-expired lease rows (fences stay)."""
    cfg = config(ctx.obj.app)
    if cfg.result_expires is None:
        click.echo(
            "Warning: lease_result_expires is not set: accepted results are kept forever, "
            "only lease rows are swept",
            err=True,
        )
    store, table = _stores(ctx)
    counts = table.sweep(cfg.result_expires, lease_grace)
    from celery_lease.stores.sql import SQLLeaseStore

    if isinstance(store, SQLLeaseStore) and store.db is not table.db:
        extra = ResultTable(store.url, store).sweep(None, lease_grace)
        counts["leases"] += extra["leases"]
    if as_json:
        click.echo(json.dumps(counts))
    else:
        click.echo(f"swept {counts['results']} result(s), {counts['leases']} lease row(s)")
