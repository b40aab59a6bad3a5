"""The ``@code`` citations of the Promela model, parsed and checked against the source.

Each model step names the code it stands for::

    /* @code celery_lease/result_commit.py:commit_remote "elif int(fence) > lease.token:" */

a module path, a dotted name in it (a function, ``Class.method``, or a
module- or class-level assignment such as a Lua script's constant), and a
fragment of that definition's source (``\\"`` for a double quote).
:func:`problems` says, per citation, what no longer holds: the file, the
name, or the fragment inside the named definition's source (found with
``ast``, so a fragment elsewhere in the file does not count).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "model"

CITATION = re.compile(
    r'@code\s+(?P<path>[\w/.]+\.py):(?P<name>[\w.]+)\s+"(?P<fragment>(?:[^"\\]|\\.)*)"'
)


@dataclass(frozen=True)
class Citation:
    model_file: str
    line: int
    path: str
    name: str
    fragment: str

    def __str__(self) -> str:
        return f'{self.model_file}:{self.line}: {self.path}:{self.name} "{self.fragment}"'


def citations() -> list[Citation]:
    found = []
    for pml in sorted(MODEL.glob("*.pml")):
        for lineno, line in enumerate(pml.read_text().splitlines(), 1):
            for m in CITATION.finditer(line):
                fragment = m["fragment"].replace('\\"', '"').replace("\\\\", "\\")
                found.append(Citation(pml.name, lineno, m["path"], m["name"], fragment))
    return found


def _squash(text: str) -> str:
    return " ".join(text.split())


def _definition(tree: ast.Module, dotted: str) -> ast.AST | None:
    """The node a dotted name defines: a function or class, or an assignment."""
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in dotted.split("."):
        node = None
        for stmt in scope:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if stmt.name == part:
                    node = stmt
            elif isinstance(stmt, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == part for t in stmt.targets):
                    node = stmt
            elif isinstance(stmt, ast.AnnAssign):
                if isinstance(stmt.target, ast.Name) and stmt.target.id == part:
                    node = stmt
            if node is not None:
                break
        if node is None:
            return None
        scope = getattr(node, "body", [])
    return node


def problems(citation: Citation) -> str | None:
    """What no longer holds for ``citation`` (None: it still does)."""
    source_file = ROOT / citation.path
    if not source_file.is_file():
        return f"{citation}: no file {citation.path}"
    source = source_file.read_text()
    node = _definition(ast.parse(source), citation.name)
    if node is None:
        return f"{citation}: no {citation.name} in {citation.path}"
    segment = ast.get_source_segment(source, node, padded=False) or ""
    if _squash(citation.fragment) not in _squash(segment):
        return f"{citation}: the fragment is not in {citation.name}'s source"
    return None
