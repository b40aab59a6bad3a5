"""Every act a decision can return is one its executor carries out.

celery_lease.decide returns an :class:`~celery_lease.decide.Act`; the
executor (``execution.py``, ``claiming.py``, ``requeue.py``) compares it with
``outcome.act is Act.X`` and hands the rest to ``Execution.carry_out``. A row
that gains an act its call site does not handle is a defect no row test sees:
the decision is right, and the executor falls through to the wrong branch (or
to ``carry_out``'s closing ``assert``). The acts each decision can return come
from the walked cases of ``test_decide`` (decide_cases_*.py: every table row has one); what each
call site handles is read from its source, so neither side can change alone.

Pure: no servers, no workers.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from celery_lease import claiming, decide, execution, requeue
from celery_lease.decide import Act
from tests.unit.decide_cases_end import END
from tests.unit.decide_cases_requeue import REQUEUE
from tests.unit.decide_cases_start import START


@dataclass(frozen=True)
class Site:
    """Where a decision's outcome is acted on."""

    function: Callable[..., Any]
    #: the act the code after the last comparison stands for (no comparison
    #: names it): the function's own closing lines, checked by reading them
    fallthrough: Act | None = None


#: decision -> the function that calls it and acts on its outcome
SITES: dict[str, Site] = {
    "decide_claim": Site(claiming.claim),
    "decide_lookup": Site(execution.Execution.prepare),
    # after the comparisons: LEASE_REJECTED and Ignore, backend untouched
    "decide_start": Site(execution.Execution.prepare, fallthrough=Act.REJECT_ENDED),
    # no REQUEUE: the body runs
    "decide_body_start": Site(execution.Execution.run, fallthrough=Act.RUN),
    "decide_duplicate": Site(execution.Execution.duplicate),
    "decide_body_error": Site(execution.Execution._unless_overtaken),
    # accepted: the value is returned
    "decide_commit": Site(execution.Execution.commit, fallthrough=Act.RUN),
    "decide_not_done": Site(execution.Execution.not_done),
    "decide_end": Site(execution.Execution.end),
    # counted or not, under the limit: published with its deferral count
    "decide_defer": Site(execution.Execution.defer, fallthrough=Act.DEFER),
    # no other copy queued: publish it and mark it
    "decide_republish": Site(requeue.republish, fallthrough=Act.PUBLISH),
}


def _tree(function: Callable[..., Any]) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def _acts_named(tree: ast.AST) -> set[Act]:
    """The acts a function names (``Act.X``): those it compares an outcome with."""
    return {
        Act[node.attr]
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "Act"
    }


def _names(tree: ast.AST, name: str) -> bool:
    """Whether the function refers to ``name`` (``decide.name``, called or passed on)."""
    return any(
        (isinstance(node, ast.Attribute) and node.attr == name)
        or (isinstance(node, ast.Name) and node.id == name)
        for node in ast.walk(tree)
    )


def _calls(tree: ast.AST, name: str) -> bool:
    """Whether the function calls ``name`` (``x.name(...)`` or ``name(...)``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == name) or (
                isinstance(f, ast.Name) and f.id == name
            ):
                return True
    return False


def carried_out() -> set[Act]:
    """The acts ``Execution.carry_out`` carries out (its comparisons and its assert)."""
    return _acts_named(_tree(execution.Execution.carry_out))


def returned_acts() -> dict[str, set[Act]]:
    acts: dict[str, set[Act]] = defaultdict(set)
    for case in (*START, *END, *REQUEUE):
        acts[case.decide.__name__].add(case.act)
    return acts


def handled(site: Site) -> set[Act]:
    tree = _tree(site.function)
    acts = _acts_named(tree)
    if _calls(tree, "carry_out"):
        acts |= carried_out()
    if site.fallthrough is not None:
        acts.add(site.fallthrough)
    return acts


def test_carry_out_carries_out_what_its_docstring_says() -> None:
    assert carried_out() == {
        Act.DEFER,
        Act.REQUEUE,
        Act.LEAVE_TO_COPY,
        Act.REJECT_ENDED,
        Act.REJECT,
    }


def test_every_decision_has_a_site_and_every_site_asks_it() -> None:
    decisions = {name for name in dir(decide) if name.startswith("decide_")}
    assert decisions == set(SITES), "a decision with no executor site here (or a stale one)"
    for name, site in SITES.items():
        assert _names(_tree(site.function), name), f"{site.function.__qualname__} never asks {name}"


@pytest.mark.parametrize("name", sorted(SITES))
def test_every_act_a_decision_returns_is_handled_where_it_is_called(name: str) -> None:
    returned = returned_acts()[name]
    assert returned, f"no walked case of {name} in test_decide"
    missing = returned - handled(SITES[name])
    assert missing == set(), (
        f"{SITES[name].function.__qualname__} does not handle {sorted(a.name for a in missing)} "
        f"that {name} returns"
    )


@pytest.mark.parametrize("name", sorted(n for n, s in SITES.items() if s.fallthrough is not None))
def test_a_fallthrough_is_an_act_the_decision_returns(name: str) -> None:
    # A declared fall-through that no row returns would hide a missing branch.
    assert SITES[name].fallthrough in returned_acts()[name]
