"""The fast binder of plain signatures (``keys._bind_plain``) against ``inspect``.

``KeySpec.bind`` skips ``Signature.bind`` for functions whose parameters are
all positional-or-keyword: a hand-written binder, so a property test holds
it to the library's answer for every signature and call drawn: the same
arguments in the same order (defaults applied), or a refusal where
``Signature.bind`` raises (the call then goes to ``Signature.bind`` and its
error).
"""

from __future__ import annotations

import inspect
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_lease.keys import _bind_plain, _plain_parameters

NAMES = ["a", "b", "c", "d", "e"]


@st.composite
def signatures_and_calls(draw: Any) -> tuple[inspect.Signature, tuple[Any, ...], dict[str, Any]]:
    n = draw(st.integers(0, len(NAMES)))
    first_default = draw(st.integers(0, n))  # parameters from here on have defaults
    params = [
        inspect.Parameter(
            name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=(f"d-{name}" if i >= first_default else inspect.Parameter.empty),
        )
        for i, name in enumerate(NAMES[:n])
    ]
    sig = inspect.Signature(params)
    args = tuple(draw(st.lists(st.integers(), max_size=n + 1)))
    kw_names = draw(st.lists(st.sampled_from([*NAMES, "zz"]), unique=True, max_size=4))
    kwargs = {k: draw(st.integers()) for k in kw_names}
    return sig, args, kwargs


@settings(max_examples=2000, deadline=None)
@given(signatures_and_calls())
def test_plain_binding_agrees_with_signature_bind(
    case: tuple[inspect.Signature, tuple[Any, ...], dict[str, Any]],
) -> None:
    sig, args, kwargs = case
    plain = _plain_parameters(sig)
    assert plain is not None
    got = _bind_plain(plain, args, kwargs)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        assert got is None, f"{sig}{args}{kwargs}: bound {got}, inspect refuses"
        return
    bound.apply_defaults()
    assert got is not None, f"{sig}{args}{kwargs}: refused, inspect binds {bound.arguments}"
    assert list(got.items()) == list(bound.arguments.items())


def test_signatures_with_other_kinds_are_left_to_signature_bind() -> None:
    def f(a: Any, *args: Any, b: Any = 1, **kw: Any) -> None: ...

    assert _plain_parameters(inspect.signature(f)) is None
    assert _plain_parameters(None) is None
