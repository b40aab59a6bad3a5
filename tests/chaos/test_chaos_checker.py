"""The chaos checker on hand-made histories: each kind of violation is reported, a clean
history passes; and the broker-AOF reader on a hand-made AOF.

The clean history (times are store/real seconds, tokens small for reading)::

    x0 (exclusive)
      T5  token  5  granted  90.0, lease lapsed at 93; body paused 90.01..102.5;
                    its guarded write refused -> FAILURE StaleFencingToken
      T1  token 10  granted 100.0, body 100.01..101.0, write 100.99, accepted 101.02
      T2  token 20  granted 101.05, body 101.06..102.0, write 101.99, accepted 102.02
    o0 (once)
      T3  token 30  granted 100.0, body 100.01..100.5, write 100.49, accepted 100.52
      T4  once_return duplicate -> SUCCESS with T3's value, no row
      T6  once duplicate        -> FAILURE DuplicateResult
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.chaos import aof
from tests.chaos.checker import (
    Accepted,
    Attempt,
    Backend,
    Chord,
    History,
    Protected,
    Submission,
    check,
)


def value(token: int) -> dict[str, int]:
    """The value a chaos body returns (and so what its accepted row holds)."""
    return {"token": token, "n": token // 10}


def clean() -> History:
    return History(
        submissions=[
            Submission("T1", "x0", "exclusive"),
            Submission("T2", "x0", "exclusive"),
            Submission("T5", "x0", "exclusive"),
            Submission("T3", "o0", "once"),
            Submission("T4", "o0", "once_return"),
            Submission("T6", "o0", "once"),
        ],
        attempts=[
            Attempt("a5", "T5", "x0", 5, 90.0, 90.01, 102.5, 93.0, "refused"),
            Attempt("a1", "T1", "x0", 10, 100.0, 100.01, 101.0, 104.0, "ok"),
            Attempt("a2", "T2", "x0", 20, 101.05, 101.06, 102.0, 105.05, "ok"),
            Attempt("a3", "T3", "o0", 30, 100.0, 100.01, 100.5, 104.0, "ok"),
        ],
        accepted=[
            Accepted("x0", 10, "T1", 101.02, 1, value(10)),
            Accepted("x0", 20, "T2", 102.02, 3, value(20)),
            Accepted("o0", 30, "T3", 100.52, 2, value(30)),
        ],
        protected=[
            Protected("x0", 10, "T1", 100.99, 1),
            Protected("x0", 20, "T2", 101.99, 3),
            Protected("o0", 30, "T3", 100.49, 2),
        ],
        backend={
            "T1": Backend("SUCCESS", result=value(10)),
            "T2": Backend("SUCCESS", result=value(20)),
            "T5": Backend("FAILURE", "StaleFencingToken", ("x0", 5, 20, "newer")),
            "T3": Backend("SUCCESS", result=value(30)),
            "T4": Backend("SUCCESS", result=value(30)),
            "T6": Backend("FAILURE", "DuplicateResult", ("o0", 30)),
        },
    )


def kinds(h: History) -> set[str]:
    return {v.kind for v in check(h).violations}


def test_a_clean_history_passes() -> None:
    report = check(clean())
    assert report.violations == []
    assert report.ok
    assert report.figures["executions"] == 4
    assert report.figures["writes_refused"] == 1


def test_a_stale_accepted_write_is_reported() -> None:
    h = clean()
    # T5's commit accepted after the newer token 20 wrote (and while T1 ran).
    h.accepted.append(Accepted("x0", 5, "T5", 102.6, 4))
    report = check(h)
    assert "stale_write" in {v.kind for v in report.violations}
    stale = [v for v in report.violations if v.kind == "stale_write"]
    assert any("token 5" in v.detail and "token 20" in v.detail for v in stale)


def test_a_stale_protected_write_is_reported() -> None:
    h = clean()
    h.protected.append(Protected("x0", 10, "T1", 102.1, 4))  # token 10 after 20 wrote
    assert "stale_write" in kinds(h)


def test_a_write_after_a_newer_body_started_is_stale() -> None:
    h = clean()
    # Ordered by database time the tokens still grow (T1 writes before T2's
    # first write), but T2's body had started (its token registered) already.
    h.attempts[2].start = 100.5
    h.attempts[2].acquired_at = 100.49
    h.attempts[1].expires = 100.45  # T1's lease had lapsed: no validity overlap
    report = check(h)
    assert any(
        v.kind == "stale_write" and "started at 100.500" in v.detail for v in report.violations
    )


def test_a_reused_token_is_reported() -> None:
    h = clean()
    h.attempts.append(Attempt("a6", "T2", "x0", 10, 101.5, 101.51, 101.6, 105.5, "ok"))
    assert "reused_token" in kinds(h)


def test_one_token_written_by_two_task_ids_is_reported() -> None:
    h = clean()
    h.protected.append(Protected("x0", 20, "T1", 101.995, 4))
    assert "reused_token" in kinds(h)


def test_tokens_out_of_grant_order_are_reported() -> None:
    h = clean()
    # T2's grant (later in store time) carries a smaller token than T1's.
    h.attempts[2].token = 8
    assert "token_order" in kinds(h)


def test_overlapping_grants_are_reported() -> None:
    h = clean()
    # Token 20 granted at 100.5 while token 10 was valid (until at least 101.0).
    h.attempts[2].acquired_at = 100.5
    report = check(h)
    overlap = [v for v in report.violations if v.kind == "overlap"]
    assert overlap and "granted at 100.500" in overlap[0].detail


def test_overlapping_bodies_with_the_older_result_accepted_are_reported() -> None:
    h = clean()
    # T1's lease lapsed at 100.4 (no validity overlap) but its body ran on
    # to 101.0 while T2's body ran from 100.6, and T1's result was accepted.
    h.attempts[1].expires = 100.4
    h.attempts[2].acquired_at = 100.59
    h.attempts[2].start = 100.6
    report = check(h)
    assert any(
        v.kind == "overlap" and "ran at the same time" in v.detail for v in report.violations
    )


def test_overlapping_bodies_are_fine_when_the_older_commit_was_refused() -> None:
    h = clean()  # T5's body overlaps T1's and T2's; its commit was refused
    assert not [v for v in check(h).violations if v.kind == "overlap"]


def test_a_once_mode_double_accept_is_reported() -> None:
    h = clean()
    h.attempts.append(Attempt("a4", "T4", "o0", 40, 101.0, 101.01, 101.5, 105.0, "ok"))
    h.accepted.append(Accepted("o0", 40, "T4", 101.52, 5))
    h.protected.append(Protected("o0", 40, "T4", 101.49, 5))
    assert "once_double" in kinds(h)


def test_a_task_id_accepted_twice_is_reported() -> None:
    h = clean()
    h.attempts.append(Attempt("a7", "T2", "x0", 25, 102.1, 102.11, 102.5, 106.0, "ok"))
    h.accepted.append(Accepted("x0", 25, "T2", 102.52, 6))
    assert "task_double_accept" in kinds(h)


def test_a_lost_key_is_reported() -> None:
    h = clean()
    h.submissions.append(Submission("T7", "x9", "exclusive"))
    report = check(h)
    assert {"lost_key", "lost_task"} <= {v.kind for v in report.violations}
    assert report.lost_plugin == ["T7"]
    assert not report.ok


def test_a_task_lost_by_the_redis_transport_is_counted_apart() -> None:
    h = clean()
    h.submissions.append(Submission("T7", "x9", "exclusive"))
    h.transport_lost = {"T7": "popped, never unacked"}
    report = check(h)
    assert report.violations == []
    assert report.lost_broker == ["T7"] and report.lost_keys_broker == ["x9"]
    assert report.ok


def test_on_rabbitmq_nothing_may_be_lost() -> None:
    h = clean()
    h.broker = "amqp"
    h.submissions.append(Submission("T7", "x9", "exclusive"))
    h.transport_lost = {"T7": "popped, never unacked"}
    report = check(h)
    assert {"lost_key", "lost_task"} <= {v.kind for v in report.violations}


def test_a_non_final_backend_state_is_a_lost_task() -> None:
    h = clean()
    h.backend["T2"] = Backend("STARTED")
    assert "lost_task" in kinds(h)


def test_an_accepted_task_whose_backend_says_failure_is_reported() -> None:
    h = clean()
    # A stale copy of T2 overwrote T2's SUCCESS.
    h.backend["T2"] = Backend("FAILURE", "StaleFencingToken", ("x0", 15, 20, "newer"))
    assert "accepted_outcome" in kinds(h)


@pytest.mark.parametrize("state", ["PENDING", "STARTED", "RETRY"])
def test_an_accepted_task_left_unfinished_in_the_backend_is_reported(state: str) -> None:
    # The worker died between the fenced commit and the backend write, and
    # nothing wrote SUCCESS afterwards.
    h = clean()
    h.backend["T2"] = Backend(state)
    report = check(h)
    found = [v for v in report.violations if v.kind == "accepted_outcome"]
    assert len(found) == 1 and "T2" in found[0].detail and state in found[0].detail


def test_an_accepted_task_whose_storing_copy_the_redis_transport_lost_is_counted_apart() -> None:
    # Its committer was killed before the backend write; the copy that would
    # have stored SUCCESS was then lost by the transport (AOF-proven).
    h = clean()
    del h.backend["T2"]
    h.transport_lost = {"T2": "popped, never unacked"}
    report = check(h)
    assert report.violations == [] and report.lost_broker == ["T2"]
    h.broker = "amqp"  # RabbitMQ loses nothing: there it is a violation
    assert {"accepted_outcome", "lost_task"} <= kinds(h)


def test_an_accepted_task_with_no_backend_state_at_all_is_reported() -> None:
    h = clean()
    del h.backend["T1"]
    assert {"accepted_outcome", "lost_task"} <= kinds(h)


def test_success_with_another_value_than_the_accepted_one_is_reported() -> None:
    h = clean()
    # e.g. a re-run after a lost backend write stored its own, unaccepted value
    h.backend["T2"] = Backend("SUCCESS", result=value(21))
    report = check(h)
    assert [v.kind for v in report.violations] == ["accepted_outcome"]
    assert "'token': 21" in report.violations[0].detail


def test_a_once_return_duplicate_with_another_value_is_reported() -> None:
    h = clean()
    h.backend["T4"] = Backend("SUCCESS", result=None)
    assert kinds(h) == {"accepted_outcome"}


def test_unknown_values_are_not_compared() -> None:
    h = clean()
    h.accepted = [Accepted(r.key, r.token, r.task_id, r.accepted_at, r.id) for r in h.accepted]
    h.backend = {
        t: Backend(b.state, b.exc_type, b.exc_args) if b.state == "SUCCESS" else b
        for t, b in h.backend.items()
    }
    assert check(h).violations == []


def test_success_without_an_accepted_result_is_reported() -> None:
    h = clean()
    h.backend["T5"] = Backend("SUCCESS")
    assert "backend" in kinds(h)


def test_fenced_with_the_accepted_token_is_reported() -> None:
    h = clean()
    h.submissions.append(Submission("T8", "x0", "exclusive"))
    h.backend["T8"] = Backend("FAILURE", "StaleFencingToken", ("x0", 20, 21, ""))
    assert "backend" in kinds(h)


def test_fenced_work_nobody_newer_did_is_lost_work() -> None:
    h = clean()
    # T2 (token 20) is fenced too, and nothing newer was accepted.
    h.accepted = [r for r in h.accepted if r.token != 20]
    h.backend["T2"] = Backend("FAILURE", "StaleFencingToken", ("x0", 20, 21, ""))
    assert "lost_work" in kinds(h)


def test_an_ended_task_id_that_ends_failure_passes() -> None:
    h = clean()
    h.ended = {"T5": 5}  # T5 fenced by T2's newer result, its end recorded first
    assert check(h).violations == []
    assert check(h).figures["ended"] == 1


def test_an_ended_task_id_with_an_accepted_row_is_reported() -> None:
    h = clean()
    h.ended = {"T2": 15}  # a mark on T2, whose copy (token 20) was accepted
    assert "ended_accept" in kinds(h)


def test_an_ended_task_id_that_turned_successful_is_reported() -> None:
    h = clean()
    h.ended = {"T5": 5}
    h.backend["T5"] = Backend("SUCCESS", result=value(20))
    assert "ended_outcome" in kinds(h)


def test_an_unexpected_failure_is_reported() -> None:
    h = clean()
    h.backend["T5"] = Backend("FAILURE", "OperationalError", ("server closed",))
    assert "unexpected_failure" in kinds(h)


def test_a_result_without_a_body_is_a_phantom() -> None:
    h = clean()
    h.accepted.append(Accepted("x0", 30, "T9", 103.0, 9))
    assert "phantom" in kinds(h)


# -- the broker AOF ----------------------------------------------------------


def _resp(*args: str | bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a.encode() if isinstance(a, str) else a
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def _payload(task_id: str, tag: str) -> str:
    return json.dumps({"body": "", "headers": {"id": task_id}, "properties": {"delivery_tag": tag}})


@pytest.fixture
def broker_dir(tmp_path: Path) -> Path:
    adir = tmp_path / "appendonlydir"
    adir.mkdir()
    (adir / "appendonly.aof.manifest").write_text(
        "file appendonly.aof.1.base.aof seq 1 type b\nfile appendonly.aof.1.incr.aof seq 1 type i\n"
    )
    (adir / "appendonly.aof.1.base.aof").write_bytes(b"")
    p1, p2, p3 = _payload("T1", "g1"), _payload("T2", "g2"), _payload("T3", "g3")
    unacked1 = json.dumps([json.loads(p1), "", "celery"])
    restored3 = json.dumps([json.loads(p3), "", "celery"])
    cmds = [
        _resp("SELECT", "0"),
        _resp("LPUSH", "celery", p1),
        _resp("LPUSH", "celery", p2),
        _resp("LPUSH", "celery", p3),
        _resp("RPOP", "celery"),  # T1: popped ...
        _resp("MULTI"),
        _resp("ZADD", "unacked_index", "1", "g1"),
        _resp("HSET", "unacked", "g1", unacked1),  # ... and recorded unacked
        _resp("EXEC"),
        _resp("RPOP", "celery"),  # T2: popped and never recorded: lost
        _resp("RPOP", "celery"),  # T3: popped, recorded, acked
        _resp("HSET", "unacked", "g3", restored3),
        _resp("HDEL", "unacked", "g3"),
        _resp("HDEL", "unacked", "g1"),
    ]
    data = b"".join(cmds) + b"*3\r\n$5\r\nLPUSH\r\n$3\r\nce"  # a torn tail
    (adir / "appendonly.aof.1.incr.aof").write_bytes(data)
    return tmp_path


def test_the_aof_proves_a_message_popped_and_never_recorded_unacked(broker_dir: Path) -> None:
    files, base_empty = aof.aof_files(broker_dir)
    assert base_empty and len(files) == 1
    log = aof.analyze(files, base_empty=base_empty)
    assert log.commands == 14  # the torn tail is ignored
    assert set(log.transport_lost()) == {"T2"}
    assert log.messages["g1"].unacked == 1 and log.messages["g1"].lost == 0
    assert log.queued_at_end == 0 and log.unacked_at_end == 0


def test_the_aof_proves_nothing_when_its_history_is_incomplete(broker_dir: Path) -> None:
    (broker_dir / "appendonlydir" / "appendonly.aof.1.base.aof").write_bytes(
        _resp("LPUSH", "celery", _payload("T0", "g0"))
    )
    files, base_empty = aof.aof_files(broker_dir)
    assert not base_empty
    assert aof.analyze(files, base_empty=base_empty).transport_lost() == {}


def test_a_final_backend_state_that_changes_is_reported() -> None:
    h = clean()
    h.backend_history = {
        "T1": [Backend("SUCCESS")],
        # A stale copy of T2 stored FAILURE while T2's owner still ran; then SUCCESS.
        "T2": [Backend("FAILURE", "StaleFencingToken", ("x0", 15, 20, "")), Backend("SUCCESS")],
    }
    report = check(h)
    assert [v.kind for v in report.violations] == ["backend_flip"]
    assert "FAILURE StaleFencingToken -> SUCCESS" in report.violations[0].detail


def test_a_backend_history_without_changes_passes() -> None:
    h = clean()
    h.backend_history = {t: [b] for t, b in h.backend.items()}
    h.backend_history["T5"].append(h.backend["T5"])  # the same state written twice
    assert check(h).violations == []


def _written(h: History) -> dict[str, list[Backend]]:
    """The lease backend's history of the clean run: each final state written
    once, by its accepted token at its accepted time; T5's FAILURE by its own
    token after its body ended (T5 is its own task id: T1 and T2 are others)."""
    at = {"T1": (10, 101.02), "T2": (20, 102.02), "T3": (30, 100.52), "T5": (5, 102.6)}
    return {
        t: [Backend(b.state, b.exc_type, b.exc_args, b.result, *at[t])]
        for t, b in h.backend.items()
        if t in at
    }


def test_a_lease_backend_history_of_current_tokens_passes() -> None:
    h = clean()
    h.backend_history = _written(h)
    h.backend_history["T1"].insert(0, Backend("STARTED", token=10, written_at=100.02))
    assert check(h).violations == []


def test_a_backend_write_by_an_older_token_after_a_newer_one_is_reported() -> None:
    h = clean()
    h.backend_history = _written(h)
    # T2's owner (token 20) wrote STARTED; then a write by token 12 landed.
    h.backend_history["T2"][:0] = [
        Backend("STARTED", token=20, written_at=101.07),
        Backend("RETRY", token=12, written_at=101.5),
    ]
    # Both rules see it: an older token after a newer one, and after T2's own grant of 20.
    found = check(h).violations
    assert {(v.kind, v.key) for v in found} == {("stale_backend_write", "x0")}
    assert [v.detail for v in found] == [
        "task T2: RETRY by token 12 after STARTED by token 20",
        "task T2: RETRY by token 12 written at 101.500, after token 20 of the same task id "
        "was granted at 101.050",
    ]


def test_a_backend_write_after_a_newer_copy_of_its_task_id_was_granted_is_reported() -> None:
    h = clean()
    h.backend_history = _written(h)
    # A second copy of T5 was granted token 25 at 102.1 (its body wrote nothing);
    # T5's FAILURE by token 5 landed at 102.6: stale, though no row held 25 yet.
    h.attempts.append(Attempt("a5b", "T5", "x0", 25, 102.1, 102.11, 102.3, 106.1, None))
    (v,) = check(h).violations
    assert (v.kind, v.key) == ("stale_backend_write", "x0")
    assert "after token 25 of the same task id was granted at 102.100" in v.detail


def test_the_aof_shows_a_message_stranded_by_a_worker_clock_an_hour_ahead(tmp_path: Path) -> None:
    adir = tmp_path / "appendonlydir"
    adir.mkdir()
    (adir / "appendonly.aof.manifest").write_text("file appendonly.aof.1.incr.aof seq 1 type i\n")
    p = _payload("T1", "g1")
    cmds = [
        _resp("LPUSH", "celery", p),
        _resp("RPOP", "celery"),
        _resp("ZADD", "unacked_index", str(1000.0 + 3600), "g1"),  # the worker's time(): +1 h
        _resp("HSET", "unacked", "g1", json.dumps([json.loads(p), "", "celery"])),
    ]
    (adir / "appendonly.aof.1.incr.aof").write_bytes(b"".join(cmds))
    files, base_empty = aof.aof_files(tmp_path)
    log = aof.analyze(files, base_empty=base_empty, now=1005.0, visibility_timeout=10)
    assert log.stranded == {"g1": ("T1", 3605.0)}
    assert "restorable only in 3605s" in log.transport_lost()["T1"]
    # A message unacked for a moment by a worker with a true clock is not stranded.
    log = aof.analyze(files, base_empty=base_empty, now=1000.0 + 3600 + 11, visibility_timeout=10)
    assert log.stranded == {} and log.transport_lost() == {}


def test_the_clock_map_follows_a_step_of_the_real_time_clock() -> None:
    """A long run saw the machine's real-time clock stepped by +15 s: bodies
    after the step must be placed with the new offset, bodies before it with
    the old one (one offset taken at the start made 734 spurious stale_write
    violations out of a correct run)."""
    from tests.chaos.records import ClockMap

    clock = ClockMap()
    clock.samples = [(100.0, 1_000.0), (200.0, 1_015.0)]
    assert clock.real(150.0) == 1_150.0
    assert clock.real(250.0) == 1_265.0
    assert clock.real(50.0) == 1_050.0  # before the first sample: the first offset


# -- chords (tests/chaos/chord_checks.py) ---------------------------------------------


def chorded(callback: Backend | None, runs: list[list[object]] | None = None) -> History:
    """The clean history, with T1 and T2 the header of a chord whose callback is C."""
    h = clean()
    h.chords = [Chord("C", ("T1", "T2"))]
    if callback is not None:
        h.callbacks = {"C": callback}
    h.collected = {"C": runs} if runs is not None else {}
    return h


def test_a_chord_whose_callback_got_its_header_passes() -> None:
    header = [value(10), value(20)]
    h = chorded(Backend("SUCCESS", result=header), [header])
    report = check(h)
    assert report.violations == []
    assert report.figures["chords_succeeded"] == 1


def test_a_callback_run_twice_with_the_same_values_passes() -> None:
    """At least once: a worker killed after the publish, before Celery's clean-up."""
    header = [value(10), value(20)]
    assert kinds(chorded(Backend("SUCCESS", result=header), [header, header])) == set()


def test_a_chord_whose_callback_never_ended_is_lost() -> None:
    assert kinds(chorded(None)) == {"chord_lost"}
    assert kinds(chorded(Backend("PENDING"))) == {"chord_lost"}


@pytest.mark.parametrize(
    "callback, runs",
    [
        (Backend("SUCCESS", result=[value(20), value(10)]), [[value(20), value(10)]]),  # order
        (Backend("SUCCESS", result=[value(10), value(20)]), []),  # stored, never ran
        (Backend("SUCCESS", result=[value(10), value(20)]), [[value(10)]]),  # a run short
        (Backend("FAILURE", "ChordError", ("x",)), []),  # failed over a header of successes
    ],
    ids=["order", "never-ran", "run-short", "failed"],
)
def test_a_callback_that_does_not_match_its_header_is_reported(
    callback: Backend, runs: list[list[object]]
) -> None:
    assert kinds(chorded(callback, runs)) == {"chord_callback"}


def test_a_chord_with_a_failed_member_fails_its_callback() -> None:
    h = chorded(Backend("FAILURE", "ChordError", ("Dependency T5 raised",)))
    h.chords = [Chord("C", ("T1", "T5"))]
    assert kinds(h) == set()
    h.collected = {"C": [[value(10), None]]}
    assert kinds(h) == {"chord_callback"}, "a callback ran over a failed header"


def test_a_chord_with_a_member_lost_is_left_to_lost_task() -> None:
    h = chorded(None)
    h.backend = {k: v for k, v in h.backend.items() if k != "T2"}
    h.transport_lost = {"T2": "popped, never recorded unacked"}
    report = check(h)
    assert report.violations == [] and report.lost_broker == ["T2"]
    assert report.figures["chords_member_lost"] == 1
