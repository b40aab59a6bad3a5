"""The protocol model (``model/``, docs/model.md), checked exhaustively by spin.

Per configuration (Redis leases + SQL results, one PostgreSQL database, etcd
leases + SQL results): no property is violated anywhere in the bounded state
space, and the search covered all of it; when the faults stop, the system
settles. Each mutation of the protocol yields a counterexample for the
property it breaks, replayed with ``spin -t``. The defects the model found in
the real protocol are fixed: the old code of defects 2 and 4 (mutation g, the
code before the end mark) still has their counterexamples, and the end mark
covers the old code of 1 and 3 too (docs/model.md, "What the model found").

``--model-deep`` raises the bounds (minutes per configuration).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.model.spin import CONFIGS, Result, check

pytestmark = pytest.mark.usefixtures("spin_tools")

#: Default: 2 workers, 2 task ids on 1 key, both modes, every fault once.
DEFAULT: tuple[str, ...] = ()
#: Deep: a third worker (every fault but the lost reply: with it too, the
#: space outgrows memory).
DEEP = ("NW=3", "MAX_LOSS=0")
#: Liveness, default: every fault but the pause and the redelivery (fairness
#: multiplies the states by the processes; the deep run has every fault).
LIVE_DEFAULT = ("MAX_PAUSE=0", "MAX_REDELIVER=0")
LIVE_DEEP: tuple[str, ...] = ()


@pytest.fixture
def deep(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--model-deep"))


def _report(result: Result, record_property: Callable[[str, object], None]) -> None:
    print(result.figures())
    record_property("model", result.figures())


def _violation(result: Result) -> str:
    return f"{result.violated}\n" + "\n".join(result.trail)


@pytest.mark.parametrize("config", CONFIGS)
def test_no_violation_in_the_whole_state_space(
    config: str, deep: bool, record_property: Callable[[str, object], None]
) -> None:
    bounds = DEEP if deep else DEFAULT
    result = check(config, bounds, optimize="-O2" if deep else "-Og", collapse=deep)
    _report(result, record_property)
    assert result.errors == 0, _violation(result)
    assert result.exhaustive, result.output
    assert result.stored > 100_000, result.output  # the model ran, not a stub


@pytest.mark.parametrize("config", CONFIGS)
def test_settles_when_the_faults_stop(
    config: str, deep: bool, record_property: Callable[[str, object], None]
) -> None:
    bounds = LIVE_DEEP if deep else LIVE_DEFAULT
    optimize = "-O2" if deep else "-Og"
    result = check(config, bounds, liveness=True, optimize=optimize, collapse=deep)
    _report(result, record_property)
    assert "never claim         \t+ (settles)" in result.output, result.output
    assert result.errors == 0, _violation(result)
    assert result.exhaustive, result.output


#: The mutations' shortest counterexamples need no crash and no lost reply:
#: searched without them, breadth first, they are found in seconds.
MUTATION_BOUNDS = ("MAX_CRASH=0", "MAX_LOSS=0")
#: mutation -> (configuration, its macro and the switches it needs, the property it breaks)
MUTATIONS = {
    "a_no_registration": ("redis", ("MUT_A",), "stale_accept"),
    "b_committed_tokens_only": ("colocated", ("MUT_B", "OFF_STALE_LEASE"), "stale_accept"),
    "c_ownership_outside_the_lock": ("redis", ("MUT_C",), "stale_lease"),
    "d_backend_before_commit": ("redis", ("MUT_D",), "stale_copy_write"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_mutation_is_caught(name: str) -> None:
    config, defines, prop = MUTATIONS[name]
    result = check(config, defines + MUTATION_BOUNDS, bfs=True, optimize="-O0")
    assert result.violated == prop, result.output
    assert result.trail, "spin -t replayed no step of the counterexample"


def test_a_redis_failover_breaks_one_grant_at_a_time() -> None:
    """A failover that loses a claim: two grants valid at once (invariant 2
    needs a store that keeps what it acknowledged)."""
    result = check("redis", ("MAX_DATALOSS=1",), optimize="-O0")
    assert result.violated == "two_grants", result.output


def test_after_a_redis_failover_the_fence_comparison_refuses_the_stale_commit() -> None:
    """With a failover that restores the old owner's tombstone, Redis says "still
    the owner" to it: only the fence row's comparison refuses it (mutation b)."""
    bounds = ("MAX_DATALOSS=1", "RESULTS_ONLY", "MAX_CRASH=0", "MAX_PAUSE=0", "MAX_REDELIVER=0")
    assert check("redis", bounds, optimize="-O0").errors == 0
    result = check("redis", (*bounds, "MUT_B"), optimize="-O0")
    assert result.violated == "stale_accept", result.output


def test_the_literal_stale_token_fails_only_in_the_documented_window() -> None:
    """Issue 23's wording, "a newer grant existed when it was written", is
    broken by the unmutated protocol: the commit releases the lease inside its
    transaction, so a new owner can claim before the row is written
    (results.py's window). stale_accept is what the window must keep: that
    owner's body starts only after the commit is decided."""
    bounds = ("LITERAL_STALE", "MAX_CRASH=0", "MAX_LOSS=0")
    result = check("redis", bounds, bfs=True, optimize="-O0")
    assert result.violated == "stale_literal", result.output
    assert any("releases token" in step for step in result.trail), result.trail


#: Fixed defects 1 and 3 -> (configuration, the mutation that restores the
#: old code of its fix): docs/model.md (e) and (f). The end mark covers their
#: old code too (its checks under the key's lock: an accepted row of the task
#: id; a run-out etcd lease's commit, refused once the mark is made), so each
#: finds nothing now; the old code of both and of the end mark (mutation g)
#: breaks stale_copy_write, as g does alone. Deep runs only (a third of a
#: minute each, with every fault: each needed a failed read or a pause).
FIXED = {
    "e_unreadable_read_taken_for_no": ("redis", "MUT_E"),
    "f_etcd_run_out_lease_ownerless": ("etcd", "MUT_F"),
}


@pytest.mark.parametrize("name", FIXED)
def test_the_end_mark_covers_a_fixed_defects_old_code(
    name: str, deep: bool, record_property: Callable[[str, object], None]
) -> None:
    if not deep:
        pytest.skip("with --model-deep")
    config, mutation = FIXED[name]
    result = check(config, (mutation,), optimize="-O2")
    _report(result, record_property)
    assert result.errors == 0, _violation(result)
    assert result.exhaustive, result.output


#: Defects 2 and 4 (docs/model.md), fixed by the end mark; mutation g
#: restores the code before it (no mark, no commit guard). defect ->
#: (configuration, bounds, the property the old code breaks). The flip is what
#: both are about: the old code also breaks stale_copy_write (its FAILURE is
#: written while another copy of the task id holds a newer grant), which the
#: search would find first.
END_MARK = {
    "not_done_races_a_copy": ("redis", ("OFF_STALE_COPY_WRITE",), "backend_flip"),
    "first_delivery_skips_its_state": (
        "colocated",
        ("NW=3", "MAX_LOSS=0", "OFF_STALE_COPY_WRITE"),
        "backend_flip",
    ),
}


@pytest.mark.parametrize("name", END_MARK)
def test_the_code_before_the_end_mark_flips_a_final_state(name: str) -> None:
    config, bounds, prop = END_MARK[name]
    result = check(config, (*bounds, "MUT_G"), optimize="-O0")
    assert result.violated == prop, result.output
    assert any("writes T0 FAILURE" in step for step in result.trail), result.trail


def test_the_end_mark_closes_the_flip(record_property: Callable[[str, object], None]) -> None:
    """Defect 4's bounds with the end mark, every property checked: nothing in
    the whole bounded space. (Defect 2's bounds are the default check's.)"""
    config, bounds, _ = END_MARK["first_delivery_skips_its_state"]
    bounds = tuple(b for b in bounds if b != "OFF_STALE_COPY_WRITE")
    result = check(config, bounds, optimize="-O2")
    _report(result, record_property)
    assert result.errors == 0, _violation(result)
    assert result.exhaustive, result.output


def test_the_end_mark_needs_its_holder_check() -> None:
    """Mutation h: the mark of a take-over without the holder check (a
    holder that is gone, or a copy of a task id that ended). Two task ids of
    one key then end each other and the key's work is lost: with two pauses
    (the default bounds have one, and there the mutation finds nothing)."""
    result = check("colocated", ("MUT_H", "MAX_PAUSE=2"), optimize="-O0")
    assert result.violated == "lost_key", result.output
    ended = ("ended", "ended: no answer", "ended: marked before")
    for t in ("T0", "T1"):
        marks = [f"marks {t} {e}" for e in ended]
        assert any(step.endswith(m) for step in result.trail for m in marks), result.trail


#: PostgreSQL's READ COMMITTED to the letter (``PG_STATEMENT_CLOCK``: the
#: colocated commit's statement reads its clock and takes its snapshot before
#: it waits for the lease row's lock), with the two pauses the race needs.
STATEMENT_CLOCK = ("PG_STATEMENT_CLOCK", "MAX_PAUSE=2", "MAX_CRASH=0", "MAX_LOSS=0")


def test_the_colocated_commit_reads_the_end_marks_in_its_snapshot() -> None:
    """docs/model.md, finding 5 (fixed; mutation i is the code before). A mark
    made while the colocated commit's statement waits for the lease row is not
    seen by it, and the statement finds its lease live by its own clock: a
    copy whose lease ran out meanwhile was accepted after its task id's end
    mark. The mark now refuses while an unreleased lease row names another
    grant of its task id, live or run out."""
    result = check("colocated", (*STATEMENT_CLOCK, "MUT_I"), bfs=True, optimize="-O0")
    assert result.violated == "ended_accept", result.output
    assert any("marks T0 ended" in step for step in result.trail), result.trail
    assert check("colocated", STATEMENT_CLOCK, optimize="-O2").errors == 0


# -- the lease+ result backend (LEASE_BACKEND) -----------------------------------
#
# With ``result_backend = "lease+<the result database>"`` the accepted row and
# the task's SUCCESS are one transaction, the tracer's SUCCESS write is a no-op,
# and celery-lease's other writes are fenced by the writer's token against the
# record's (celery_lease/sql/meta_queries.py). Leases in the result database
# and Redis leases with SQL results: the etcd configuration shares the Redis
# one's result side.
BACKEND_CONFIGS = ("redis", "colocated")


@pytest.mark.parametrize("config", BACKEND_CONFIGS)
def test_no_violation_with_the_lease_backend(
    config: str, deep: bool, record_property: Callable[[str, object], None]
) -> None:
    bounds = ("LEASE_BACKEND",) + (DEEP if deep else DEFAULT)
    result = check(config, bounds, optimize="-O2" if deep else "-Og", collapse=deep)
    _report(result, record_property)
    assert result.errors == 0, _violation(result)
    assert result.exhaustive, result.output
    assert result.stored > 100_000, result.output


@pytest.mark.parametrize("name", END_MARK)
def test_the_lease_backend_alone_does_not_close_the_flip(name: str) -> None:
    """Without the end mark (mutation g) the lease+ backend's token fence
    does not prevent the flip: it compares the writer's token with the task
    id's record, and the stale copy's FAILURE lands before the newer copy of
    the same task id has written anything (docs/model.md)."""
    config, bounds, prop = END_MARK[name]
    result = check(config, (*bounds, "MUT_G", "LEASE_BACKEND"), optimize="-O0")
    assert result.violated == prop, result.output
    assert any("writes T0 FAILURE" in step for step in result.trail), result.trail
