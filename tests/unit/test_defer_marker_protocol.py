"""The deferral marker's protocol, every interleaving hypothesis draws.

A task id whose key stays busy is deferred again and again; each deferral
publishes a copy and moves the store's marker to it (``requeue.republish``,
``decide.decide_republish``, ``LeaseStore.mark(replace=...)``). Faults drawn
between any two steps: the broker restoring a copy its worker still holds
(twins), the marker read failing, the marker write refused, the publisher
dying between the publish and the marker (its message redelivered), the
marker expiring. Properties:

- never lost: at every step at least one copy of the task id is queued;
- one line again: once faults stop, the copies collapse to one within a
  few deliveries, and stay one.

Pure protocol, no servers: the marker here has the store's compare-and-set
semantics; that each real store keeps them is the contract suite's test
(``test_a_marker_is_replaced_only_from_an_owner_named_and_by_one_of_many``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_lease import decide
from celery_lease.decide import ANY_MARKER, Act, Failed, Read, Republish


@dataclass(frozen=True)
class Copy:
    defer_id: str | None
    replaces: str | None


class World:
    def __init__(self) -> None:
        self.marker: str | None = None
        self.queue: list[Copy] = [Copy(None, None)]  # the task's first message
        self.ids = (f"c{i}" for i in itertools.count())

    def mark(self, owner: str, replace_: tuple[str, ...]) -> None:
        """LeaseStore.mark: set if absent, own, or one of ``replace_``."""
        if self.marker is None or self.marker == owner or self.marker in replace_:
            self.marker = owner

    def deliver(
        self, i: int, *, read_fails: bool = False, write_fails: bool = False, crash: bool = False
    ) -> None:
        copy = self.queue.pop(i % len(self.queue))
        facts = Republish(copy.defer_id, copy.replaces)
        while True:
            answer = decide.decide_republish(facts)
            if not isinstance(answer, Read):
                break
            assert answer is Read.MARKER
            facts = replace(facts, marker=Failed("down") if read_fails else self.marker)
        if answer.act is Act.DROP:
            return
        assert answer.act is Act.PUBLISH
        new = next(self.ids)
        self.queue.append(Copy(new, answer.replaces))
        if crash:  # acks_late: the message comes back; the marker never moved
            self.queue.append(copy)
            return
        if not write_fails:
            r = answer.replaces
            self.mark(new, (r,) if r not in (None, ANY_MARKER) else ())


FAULT = st.sampled_from(["none", "read", "write", "crash", "twin", "expire"])


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), FAULT), max_size=40))
def test_a_deferred_task_is_never_lost_and_its_copies_collapse_to_one(
    steps: list[tuple[int, str]],
) -> None:
    w = World()
    for i, fault in steps:
        if fault == "twin":
            w.queue.append(w.queue[i % len(w.queue)])
        elif fault == "expire":
            w.marker = None
        else:
            w.deliver(
                i, read_fails=fault == "read", write_fails=fault == "write", crash=fault == "crash"
            )
        assert w.queue, f"the task was lost after {fault!r}"
    # Faults stop: deliver, oldest first, as a broker would.
    for _ in range(4 * len(w.queue) + 4):
        w.deliver(0)
        assert w.queue, "the task was lost after the faults"
    assert len(w.queue) == 1, f"copies left: {w.queue}"


def test_the_failure_that_lost_a_probe_is_among_the_drawn() -> None:
    # Two deferrals whose marker write is refused, then a plain one: the
    # chaos run's lost probe (regression test 10 replays it on real servers).
    w = World()
    w.deliver(0)
    w.deliver(0, write_fails=True)
    w.deliver(0, write_fails=True)
    w.deliver(0)
    assert w.queue, "lost"
