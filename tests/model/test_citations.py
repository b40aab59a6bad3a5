"""Every ``@code`` citation of the model still names code that says what it quotes.

The model's steps cite the functions they stand for; a renamed function, a
moved statement or a changed condition fails here, so the model cannot
drift from the code unnoticed (update the model step, then its citation).
"""

from __future__ import annotations

import pytest

from tests.model.citations import Citation, citations, problems

CITATIONS = citations()


def test_every_model_file_cites_code() -> None:
    files = {c.model_file for c in CITATIONS}
    for name in ("grant.pml", "store_redis.pml", "store_etcd.pml", "store_colocated.pml"):
        assert name in files, f"model/{name} cites no code"
    for name in ("results.pml", "worker.pml", "commit.pml", "outcomes.pml"):
        assert name in files, f"model/{name} cites no code"


@pytest.mark.parametrize("citation", CITATIONS, ids=str)
def test_citation_holds(citation: Citation) -> None:
    assert problems(citation) is None, problems(citation)


def test_a_changed_fragment_is_caught() -> None:
    real = CITATIONS[0]
    assert problems(real) is None
    changed = Citation(real.model_file, real.line, real.path, real.name, real.fragment + " x")
    assert "fragment is not in" in (problems(changed) or "")
    gone = Citation(real.model_file, real.line, real.path, real.name + "_gone", real.fragment)
    assert "no " in (problems(gone) or "")
