"""Lease keys: derived from a task's arguments, stable across processes.

A ``lease_key`` is one of:

- a format template over the call's bound arguments: ``"payment-security-{api_id}"``
  (defaults applied, so ``f(1)`` and ``f(1, region="eu")`` with that default agree);
- a callable taking the task's arguments and returning a key or a list of keys;
- nothing: the task's name plus the SHA-256 of the canonical JSON of the bound
  arguments (sorted keys, no whitespace), which does not depend on argument
  order, dict ordering or the process's hash seed. The types Celery's JSON
  serializer carries beyond JSON (UUID, datetime, date, time, Decimal, bytes)
  are written as the envelope kombu puts them in on the wire
  (:func:`canonical_json`), so the key a client derives equals the one the
  worker derives from the decoded message.

A template renders dict arguments with their keys sorted and set arguments
with their elements sorted (recursively), so ``{"a": 1, "b": 2}`` and
``{"b": 2, "a": 1}`` give one key, and a set's hash-seed-dependent order never
leaks into a key.

Tenant scoping (:func:`scoped`) is an injective encoding, so no tenant's key
can equal another tenant's, or an unscoped key. Keys no store can hold as
given -- longer than :data:`MAX_KEY_LENGTH`, or containing NUL or a lone
surrogate -- become ``<readable prefix>~<sha256 of the whole>`` (:func:`shorten`):
deterministic and idempotent. Every store applies the same mapping at its
boundary, so a caller may pass any ``str``.

A key a task derives (:class:`KeySpec`, from arguments that may be user
input) goes through :func:`user_key` instead, which also hashes a key that
merely *looks* shortened (``...~<64 hex digits>``): otherwise a short key
crafted in that shape would pass through unchanged and equal the shortened
form of someone else's long key. Ordinary keys keep their form.

Keys starting with ``t/`` (tenant scopes) or :data:`INTERNAL_PREFIX` (the
plugin's own records, such as deferral markers) are refused as unscoped user
keys, so no user key can reach a scope or an internal record.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import hashlib
import inspect
import json
import re
import string
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery_lease.exceptions import KeyLimitExceeded, LeaseConfigError

__all__ = [
    "INTERNAL_PREFIX",
    "MAX_KEY_LENGTH",
    "KeyLimits",
    "KeySpec",
    "canonical_json",
    "check_limits",
    "scoped",
    "shorten",
    "user_key",
]

MAX_KEY_LENGTH = 200
#: Store keys of the plugin's own records (deferral markers): no user key may start so.
INTERNAL_PREFIX = "celery-lease/"
#: The tail :func:`shorten` gives a key: ``~`` and a SHA-256 in hex.
_SHORTENED = re.compile("~[0-9a-f]{64}\\Z")
#: Characters no store keeps verbatim: PostgreSQL text refuses NUL, and a lone
#: surrogate has no UTF-8 encoding.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def canonical_json(value: Any) -> str:
    """``value`` as canonical JSON: sorted keys, no whitespace, non-ASCII kept.

    The non-JSON types Celery's JSON serializer accepts are written as the
    ``{"__type__": ..., "__value__": ...}`` envelope kombu sends them in (and
    turns back into the type on receipt): ``uuid`` ``{"hex": <32 hex digits>}``,
    ``datetime``/``date``/``time`` their ``isoformat()`` (the offset as given:
    the same instant in two zones is two keys), ``decimal`` ``str()`` (its
    exponent kept: ``1.0`` and ``1.00`` are two keys), ``bytes`` the UTF-8 text
    or, if not UTF-8, ``base64``. The form is fixed here, not taken from kombu,
    so a key never changes with a kombu release.
    """
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_envelope
    )


def _envelope(value: Any) -> dict[str, Any]:
    kind: str
    encoded: Any
    if isinstance(value, uuid.UUID):
        kind, encoded = "uuid", {"hex": value.hex}
    elif isinstance(value, datetime.datetime):  # before date: a datetime is a date
        kind, encoded = "datetime", value.isoformat()
    elif isinstance(value, datetime.date):
        kind, encoded = "date", value.isoformat()
    elif isinstance(value, datetime.time):
        kind, encoded = "time", value.isoformat()
    elif isinstance(value, decimal.Decimal):
        kind, encoded = "decimal", str(value)
    elif isinstance(value, bytes):
        try:
            kind, encoded = "bytes", value.decode("utf-8")
        except UnicodeDecodeError:
            kind, encoded = "base64", base64.b64encode(value).decode("ascii")
    else:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
    return {"__type__": kind, "__value__": encoded}


def has_unstorable(text: str) -> bool:
    """True if ``text`` contains NUL or a lone surrogate (no store keeps those verbatim)."""
    return _UNSTORABLE.search(text) is not None


def shorten(key: str) -> str:
    """``key`` as every store can hold it; unchanged when it already can.

    Keys over :data:`MAX_KEY_LENGTH` characters, or containing NUL or a lone
    surrogate, become ``<prefix>~<sha256>``: the first characters (NUL and
    surrogates replaced by U+FFFD), then the SHA-256 of the whole key (its
    UTF-8 bytes, surrogates passed through), so the mapping is deterministic
    and two different keys never meet. At most :data:`MAX_KEY_LENGTH`
    characters (at most 4 bytes each, well under PostgreSQL's index limit).
    """
    if len(key) <= MAX_KEY_LENGTH and not _UNSTORABLE.search(key):
        return key
    return _hashed(key)


def user_key(key: str) -> str:
    """A derived (user-supplied) key as stores hold it, never equal to another key's
    shortened form: like :func:`shorten`, but a key already in the shortened
    shape (``...~<sha256 hex>``) is hashed too. Injective over all strings
    (short of a SHA-256 collision): a result in that shape is always the hash
    of its input, any other result is its input. Ordinary keys are unchanged."""
    if _SHORTENED.search(key) is None:
        return shorten(key)
    return _hashed(key)


def _hashed(key: str) -> str:
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    head = _UNSTORABLE.sub("\ufffd", key[: MAX_KEY_LENGTH - 66])
    return f"{head}~{digest}"


def scoped(key: str, tenant: str | None) -> str:
    """``key`` in ``tenant``'s namespace: ``t/<len>:<tenant>/<key>``; unscoped keys as given.

    Length-prefixing the tenant makes the encoding injective: ``("a:b", "c")``
    and ``("a", "b:c")`` give different strings; and since unscoped keys may
    not start with ``t/``, no unscoped key equals a scoped one. The result is
    passed through :func:`shorten` (a long tenant or key stays storable; the
    readable prefix still starts with ``t/<len>:``).
    """
    if not isinstance(key, str) or not key:
        raise LeaseConfigError(f"a lease key is a non-empty string, got {key!r}")
    if tenant is None:
        if key.startswith("t/"):
            raise LeaseConfigError(
                f"lease key {key!r}: keys starting with 't/' are reserved for tenant scopes"
            )
        if key.startswith(INTERNAL_PREFIX):
            raise LeaseConfigError(
                f"lease key {key!r}: keys starting with {INTERNAL_PREFIX!r} are reserved for "
                "celery-lease's own records"
            )
        return shorten(key)
    if not isinstance(tenant, str) or not tenant:
        raise LeaseConfigError(f"a tenant is a non-empty string, got {tenant!r}")
    if _UNSTORABLE.search(tenant):
        raise LeaseConfigError(
            f"tenant {tenant!r} contains NUL or a lone surrogate, which the result table "
            "cannot store"
        )
    return shorten(f"t/{len(tenant)}:{tenant}/{key}")


@dataclass(frozen=True)
class KeyLimits:
    """The ``lease_max_keys`` / ``lease_max_key_length`` settings."""

    max_keys: int
    max_key_length: int


def check_limits(task_name: str, keys: Sequence[Any], limits: KeyLimits) -> None:
    """Refuse a call over the limits before anything is hashed, claimed or read:
    one claim of 20,000 keys blocks a Redis server for a noticeable time."""
    if len(keys) > limits.max_keys:
        raise KeyLimitExceeded(
            f"task {task_name!r}: {len(keys)} lease keys in one call, more than "
            f"lease_max_keys ({limits.max_keys})"
        )
    for k in keys:
        if isinstance(k, str) and len(k) > limits.max_key_length:
            raise KeyLimitExceeded(
                f"task {task_name!r}: a lease key or tenant of {len(k)} characters "
                f"({k[:40]!r}...), longer than lease_max_key_length ({limits.max_key_length})"
            )


class KeySpec:
    """How one task derives its lease keys from its arguments."""

    def __init__(
        self,
        task_name: str,
        func: Callable[..., Any],
        template: str | Callable[..., Any] | None,
        *,
        bound: bool,
    ) -> None:
        self.task_name = task_name
        self.template = template
        try:
            sig = inspect.signature(func)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and bound:
            params = list(sig.parameters.values())[1:]
            sig = sig.replace(parameters=params)
        self.signature = sig
        #: Plain parameters are bound without Signature.bind, the dearest step of
        #: a per-call key (a call that does not fit still goes to it, to raise).
        self._plain = _plain_parameters(sig)
        #: What a template reads (None: all, for a nested format spec), put in order.
        self._reads: tuple[str, ...] | None = None
        if isinstance(template, str):
            self.fields = _template_fields(task_name, template)
            self._check_fields()
            if not any("{" in (spec or "") for _, _, spec, _ in string.Formatter().parse(template)):
                self._reads = tuple(dict.fromkeys(self.fields))
        elif template is not None and not callable(template):
            raise LeaseConfigError(
                f"task {task_name!r}: lease_key must be a format string or a callable, "
                f"got {template!r}"
            )
        else:
            self.fields = []

    def _check_fields(self) -> None:
        if self.signature is None:
            return
        params = self.signature.parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        for field in self.fields:
            if field not in params:
                raise LeaseConfigError(
                    f"task {self.task_name!r}: lease_key template names argument {field!r}, "
                    f"which the task does not have (its arguments: {', '.join(params) or 'none'})"
                )

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if self._plain is not None:
            arguments = _bind_plain(self._plain, args, kwargs)
            if arguments is not None:
                return arguments
        if self.signature is None:
            return {**{str(i): a for i, a in enumerate(args)}, **kwargs}
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise LeaseConfigError(
                f"task {self.task_name!r}: cannot derive its lease key, the call's arguments "
                f"do not match the task's signature: {e}"
            ) from e
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for name, p in self.signature.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
                arguments.update(arguments.pop(name))
        return arguments

    def keys(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        limits: KeyLimits | None = None,
    ) -> list[str]:
        """The call's lease keys (one or more), shortened when too long (:func:`user_key`);
        with ``limits``, refused when over them."""
        template = self.template
        if callable(template):
            produced = template(*args, **kwargs)
            found = [produced] if isinstance(produced, str) else list(produced)
        elif isinstance(template, str):
            bound = self.bind(args, kwargs)
            reads = self._reads
            if reads is None:
                arguments = {name: _ordered(v) for name, v in bound.items()}
            else:  # a field the call lacks stays missing: _format names it
                arguments = {name: _ordered(bound[name]) for name in reads if name in bound}
            return self._format(template, arguments, limits)
        else:
            arguments = self.bind(args, kwargs)
            try:
                blob = canonical_json(arguments)
            except (TypeError, ValueError) as e:
                raise LeaseConfigError(
                    f"task {self.task_name!r}: the default lease key hashes the arguments as "
                    f"JSON (plus UUID, datetime, date, time, Decimal, bytes), and these are not "
                    f"({e}); give the task a lease_key"
                ) from e
            found = [f"{self.task_name}:{hashlib.sha256(blob.encode()).hexdigest()}"]
        return self._checked(found, limits)

    def _format(
        self, template: str, arguments: Mapping[str, Any], limits: KeyLimits | None = None
    ) -> list[str]:
        try:
            key = template.format_map(arguments)
        except KeyError as e:
            raise LeaseConfigError(
                f"task {self.task_name!r}: lease_key {template!r} names argument "
                f"{e.args[0]!r}, which this call did not pass"
            ) from e
        except (AttributeError, IndexError, ValueError) as e:
            raise LeaseConfigError(
                f"task {self.task_name!r}: lease_key {template!r} cannot be formatted "
                f"from this call's arguments: {e}"
            ) from e
        return self._checked([key], limits)

    def _checked(self, found: list[Any], limits: KeyLimits | None = None) -> list[str]:
        if limits is not None:
            check_limits(self.task_name, found, limits)
        keys = [user_key(k) for k in found if isinstance(k, str) and k]
        if not keys or len(keys) != len(found):
            raise LeaseConfigError(
                f"task {self.task_name!r}: lease_key produced {found[:10]!r}; keys are "
                "non-empty strings"
            )
        return keys

    def keys_for_lookup(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str]:
        """The keys a call with (only) these arguments would lease, for reading results.

        A template needs only the arguments it names and a callable only its own
        parameters; the rest of the task's signature may be left out. The
        default key hashes *every* argument, so it still needs them all.
        """
        template = self.template
        if template is None:
            try:
                return self.keys(args, kwargs)
            except LeaseConfigError as e:
                raise LeaseConfigError(
                    f"{e}; the default lease key hashes all of the task's arguments, so "
                    "reading its result needs them all (or pass key=...)"
                ) from e
        if callable(template):
            return self.keys(*_fit(template, args, kwargs))
        named = self._named(args, kwargs)
        missing = [f for f in dict.fromkeys(self.fields) if f not in named]
        if missing:
            raise LeaseConfigError(
                f"task {self.task_name!r}: lease_key {template!r} needs argument "
                f"{missing[0]!r} to find the key (or pass key=...)"
            )
        return self._format(template, {f: _ordered(named[f]) for f in self.fields})

    def _named(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Positional and keyword arguments by parameter name, defaults filled in."""
        if self.signature is None:
            return {**{str(i): a for i, a in enumerate(args)}, **kwargs}
        params = list(self.signature.parameters.values())
        positional = [p.name for p in params if p.kind in _POSITIONAL]
        if len(args) > len(positional):
            raise LeaseConfigError(
                f"task {self.task_name!r}: {len(args)} positional arguments given, the task "
                f"takes {len(positional)}"
            )
        named: dict[str, Any] = dict(zip(positional, args))
        named.update(kwargs)
        for p in params:
            if p.name not in named and p.default is not inspect.Parameter.empty:
                named[p.name] = p.default
        return named


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _plain_parameters(
    sig: inspect.Signature | None,
) -> tuple[tuple[str, ...], frozenset[str], dict[str, Any]] | None:
    """``(names, their set, defaults)`` when every parameter is positional-or-keyword."""
    if sig is None:
        return None
    params = sig.parameters.values()
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return None
    names = tuple(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return names, frozenset(names), defaults


def _bind_plain(
    plain: tuple[tuple[str, ...], frozenset[str], dict[str, Any]],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> dict[str, Any] | None:
    """What ``Signature.bind`` + ``apply_defaults`` give for plain parameters
    (in parameter order), or None for a call they do not fit."""
    names, known, defaults = plain
    n = len(args)
    if n > len(names):
        return None
    arguments = dict(zip(names, args))
    if kwargs and any(k not in known or k in arguments for k in kwargs):
        return None
    for name in names[n:]:
        if name in kwargs:
            arguments[name] = kwargs[name]
        elif name in defaults:
            arguments[name] = defaults[name]
        else:
            return None
    return arguments


def _fit(
    func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` cut down to what ``func`` accepts (a key callable that
    names only some of the task's parameters)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return tuple(args), dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return tuple(args), dict(kwargs)
    names = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return tuple(args), {k: v for k, v in kwargs.items() if k in names}


class _SortedSet(frozenset):  # type: ignore[type-arg]
    """A set argument as a template renders it: elements in a fixed order."""

    _mutable = True

    def __repr__(self) -> str:
        items = ", ".join(sorted((repr(v) for v in self), key=str))
        if not self._mutable:
            return f"frozenset({{{items}}})" if items else "frozenset()"
        return f"{{{items}}}" if items else "set()"

    __str__ = __repr__


def _ordered(value: Any) -> Any:
    """``value`` with dict keys and set elements in a fixed order (recursively).

    Only plain ``dict``/``list``/``tuple``/``set``/``frozenset`` are rebuilt,
    so ``{d[field]}`` and ``{obj.attr}`` in a template keep working.
    """
    kind = type(value)
    if kind is dict:
        ordered = sorted(value.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        return {k: _ordered(v) for k, v in ordered}
    if kind is list:
        return [_ordered(v) for v in value]
    if kind is tuple:
        return tuple(_ordered(v) for v in value)
    if kind is set or kind is frozenset:
        out = _SortedSet(_ordered(v) for v in value)
        out._mutable = kind is set
        return out
    return value


def _template_fields(task_name: str, template: str) -> list[str]:
    fields: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise LeaseConfigError(
            f"task {task_name!r}: lease_key {template!r} is not a valid format string: {e}"
        ) from e
    for _, field, _, _ in parsed:
        if field is None:
            continue
        base = field.split(".", 1)[0].split("[", 1)[0]
        if not base or base.isdigit():
            raise LeaseConfigError(
                f"task {task_name!r}: lease_key {template!r} must name arguments, "
                f"like {{api_id}}, not positions"
            )
        fields.append(base)
    return fields
