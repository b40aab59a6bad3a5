"""No test sweeps with a zero cutoff without letting the database clock move first.

``ResultTable.sweep`` deletes what is strictly older than its cutoff, and
SQLite's clock steps by milliseconds: a row written and swept within one step
is not past a zero grace, so a test that expects it gone fails now and then,
on a fast machine only. Such a sweep goes
through ``tests.results_helpers.sweep_past_now``, which waits for the clock to
step first. Calls inside ``pytest.raises`` (refused before any sweep) and the
modules below are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
#: modules whose zero-cutoff sweeps expect no given row gone, and why
EXEMPT = {
    "contract/test_sweep_concurrency.py": "sweeps race claims; it counts rows swept, never one",
}
ARGUMENTS = ("result_expires", "lease_grace")


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 0


def _raises_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes inside a ``with pytest.raises(...)`` block."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
            isinstance(item.context_expr, ast.Call)
            and isinstance(item.context_expr.func, ast.Attribute)
            and item.context_expr.func.attr == "raises"
            for item in node.items
        ):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def zero_cutoff_sweeps(source: str) -> list[int]:
    """Lines of ``<x>.sweep(...)`` calls with a literal 0 for either cutoff."""
    tree = ast.parse(source)
    exempt = _raises_blocks(tree)
    lines = []
    for node in ast.walk(tree):
        if (
            not isinstance(node, ast.Call)
            or not isinstance(node.func, ast.Attribute)
            or node.func.attr != "sweep"
            or id(node) in exempt
        ):
            continue
        given = list(node.args[: len(ARGUMENTS)])
        given += [k.value for k in node.keywords if k.arg in ARGUMENTS]
        if any(_is_zero(arg) for arg in given):
            lines.append(node.lineno)
    return lines


def test_the_rule_finds_what_it_names() -> None:
    source = (
        "import pytest\n"
        "table.sweep(None, 0)\n"
        "table.sweep(result_expires=0.0, lease_grace=3600)\n"
        "table.sweep(None, lease_grace=5)\n"
        "with pytest.raises(ValueError):\n"
        "    table.sweep(-5, 0)\n"
        "sweep_past_now(table, None, 0)\n"
    )
    assert zero_cutoff_sweeps(source) == [2, 3]


def test_no_test_sweeps_with_a_zero_cutoff_before_the_clock_moves() -> None:
    found = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        if str(path.relative_to(TESTS)) not in EXEMPT
        for line in zero_cutoff_sweeps(path.read_text())
    ]
    assert found == [], f"sweep through tests.results_helpers.sweep_past_now: {found}"
