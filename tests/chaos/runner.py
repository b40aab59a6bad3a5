"""``python -m tests.chaos``: the fault-injection run, end to end.

1. Start private servers and N supervised workers (:mod:`tests.chaos.cluster`).
2. Submit M tasks over K keys (``exclusive`` and ``once`` keys, ``once``
   tasks with both duplicate policies), spread over the first 70 % of the
   run, bodies from 0.05 s to 3 x the TTL (so renewal matters).
3. Inject faults at random (seeded) for ``--duration`` seconds
   (:mod:`tests.chaos.faults`).
4. Heal, then let the system settle: wait (bounded by ``--settle``) until
   every task id has a final backend state and the broker holds no message.
5. Stop the workers; read the history, ``celery_lease_results``,
   ``chaos_protected``, the result backend and the broker's AOF; run the
   checker (:mod:`tests.chaos.checker`); print the figures table; exit 1 on
   any violation or task lost by the plugin.

Reproduce a run with the same ``--seed`` and options (fault times and task
timing vary with the machine; the plan and the fault sequence do not).
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, text

from tests.chaos import aof, backends, stacks
from tests.chaos.checker import (
    FINAL,
    Accepted,
    Backend,
    History,
    Protected,
    Report,
    Submission,
    check,
)
from tests.chaos.chord_checks import count_recovered, read_collected
from tests.chaos.cluster import Cluster
from tests.chaos.faults import KINDS, Injector
from tests.chaos.history import Chord
from tests.chaos.plan import cover_items, plan, plan_chords
from tests.chaos.records import ClockMap, count_log_states, read_history
from tests.chaos.table import format_table

__all__ = ["Options", "RunResult", "run"]


@dataclass
class Options:
    duration: float = 120.0
    seed: int = 7
    workers: int = 4
    concurrency: int = 2
    tasks: int = 300
    keys: int = 12
    broker: str = "redis"
    #: the result backend: Celery's Redis backend, or ``lease`` (lease+ the result database)
    backend: str = "redis"
    #: the lease store: the Redis of its own, or ``pg`` (the result database)
    store: str = "redis"
    ttl: float = 4.0
    vt: float = 10.0
    fault_rate: float = 0.2
    settle: float = 240.0
    kinds: tuple[str, ...] = KINDS
    workdir: Path | None = None
    quiet: bool = False
    #: chords of CHORD_SIZE ``exclusive`` members each, spread like the tasks
    #: (their own seeded plan; needs a backend with chords: ``lease``)
    chords: int = 0


@dataclass
class RunResult:
    report: Report
    figures: dict[str, Any]
    table: str
    workdir: Path
    settled: bool
    wall: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.report.ok


# -- the run ----------------------------------------------------------------


class Run:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.workdir = opts.workdir or Path(
            tempfile.mkdtemp(prefix=f"chaos-{opts.broker}-s{opts.seed}-")
        )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self._log_lock = threading.Lock()
        self.cluster = Cluster(
            self.workdir,
            broker=opts.broker,
            backend=opts.backend,
            store=opts.store,
            workers=opts.workers,
            concurrency=opts.concurrency,
            ttl=opts.ttl,
            vt=opts.vt,
            log=self.log,
        )
        self.rng = random.Random(opts.seed * 7919 + 1)
        self.cover_rng = random.Random(opts.seed * 7919 + 2)
        self.submitted: list[dict[str, Any]] = []
        #: every write the result backend made, per task id (read after the run)
        self.backend_history: dict[str, list[Backend]] | None = None
        #: the settle's stalls: no task ended while the broker held messages
        self.stalls: list[dict[str, Any]] = []
        self._submit_lock = threading.Lock()
        self.publish_errors = 0
        #: the chords submitted (``--chords``)
        self.chords: list[Chord] = []

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        with self._log_lock:
            with open(self.workdir / "run.log", "a") as fh:
                fh.write(line + "\n")
            if not self.opts.quiet:
                print(line, flush=True)

    def execute(self) -> RunResult:
        opts = self.opts
        started = time.monotonic()
        # The harness's clock pair: real time = monotonic + offset, sampled all
        # along the run: the machine's real-time clock can be stepped (a long
        # run here saw +15 s in three steps), and one offset taken at the start
        # then misplaces every later body against the stores' clocks.
        self.clock = ClockMap()
        self.clock.start()
        (self.workdir / "options.json").write_text(
            json.dumps({**vars(opts), "workdir": str(self.workdir), "kinds": list(opts.kinds)})
        )
        self.log(f"workdir {self.workdir}")
        try:
            self.cluster.start_servers()
            self.cluster.start_workers()
            from tests.chaos.app import build

            self.app, self.tasks = build(self.cluster.env)
            self.backend = backends.view_of(
                opts.backend, self.cluster.env, self.cluster.results_url, self.workdir
            )
            self.backend.start()
            self.cluster.supervise()
            the_plan = plan(opts)
            until = time.monotonic() + opts.duration
            submitter = threading.Thread(
                target=self.submit, args=(the_plan, time.monotonic()), daemon=True
            )
            submitter.start()
            chord_submitter = threading.Thread(
                target=self.submit_chords, args=(plan_chords(opts), time.monotonic()), daemon=True
            )
            chord_submitter.start()
            injector = Injector(
                self.cluster, self.rng, rate=opts.fault_rate, kinds=opts.kinds, log=self.log
            )
            injector.publish_probe = self.submit_probe
            injector.publish_work = self.submit_cover
            self.log(f"injecting faults for {opts.duration:.0f}s at {opts.fault_rate}/s")
            # A short run must apply every kind: the ones a loaded machine kept
            # from applying get half the duration again, alone.
            injector.run(until, cover_within=opts.duration / 2)
            submitter.join()
            chord_submitter.join()
            self.log(f"healed; faults: {dict(injector.counts)}; settling")
            settled, pending = self.settle(opts.settle)
            self.cluster.stop_supervising()
            self.cluster.stop_workers()
            self.log("workers stopped; collecting")
            try:
                history, extra = self.collect()
            finally:
                self.backend.stop()
            extra["pending_at_settle"] = pending
            report = check(history)
            figures = self.figures(report, injector, extra, settled)
            table = format_table(figures, report)
            wall = time.monotonic() - started
            figures["wall_seconds"] = round(wall, 1)
            (self.workdir / "report.json").write_text(
                json.dumps(
                    {
                        "figures": figures,
                        "violations": [str(v) for v in report.violations],
                        "lost_plugin": report.lost_plugin,
                        "lost_broker": report.lost_broker,
                    },
                    indent=1,
                )
            )
            (self.workdir / "report.txt").write_text(table + "\n")
            return RunResult(report, figures, table, self.workdir, settled, wall, extra)
        finally:
            self.cluster.shutdown()

    # -- submitting ------------------------------------------------------

    def submit(self, the_plan: list[dict[str, Any]], t0: float) -> None:
        for item in the_plan:
            delay = t0 + item["at"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self._publish(item)
        self.log(f"submitted {len(self.submitted)} tasks")

    def _publish(self, item: dict[str, Any]) -> None:
        task = getattr(self.tasks, item["policy"])
        while True:
            try:
                task.apply_async(
                    args=(item["key"], item["duration"], item["n"]),
                    task_id=item["task_id"],
                    retry=True,
                    retry_policy={"max_retries": 3, "interval_start": 0.2,
                                  "interval_step": 0.5, "interval_max": 1.0},
                )  # fmt: skip
                break
            except Exception as e:  # noqa: BLE001 - the broker is being faulted
                self.publish_errors += 1
                self.log(f"publish of {item['task_id']} failed ({e!r}); retrying")
                time.sleep(0.5)
        self._submitted(item)

    def submit_cover(self) -> None:
        """A batch of the cover phase's work (:func:`cover_items`), published now."""
        with self._submit_lock:
            first = self.opts.tasks + sum(1 for s in self.submitted if s.get("cover"))
        for item in cover_items(self.opts, self.cover_rng, first):
            self._publish({**item, "at": time.monotonic() - self.t0})

    def submit_chords(self, the_plan: list[dict[str, Any]], t0: float) -> None:
        """Each planned chord, published at its time: its members (``chaos.exclusive``,
        each also a submission) and its callback ``chaos.collect``."""
        from celery import chord

        for item in the_plan:
            delay = t0 + item["at"] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            header = [
                self.tasks.exclusive.s(m["key"], m["duration"], m["n"]).set(task_id=m["task_id"])
                for m in item["members"]
            ]
            callback = self.tasks.collect.s().set(task_id=item["callback_id"])
            while True:
                try:
                    # A failed publish goes again whole, under a new group id: a
                    # member the first one sent counts in a chord nobody waits for.
                    chord(header, callback).apply_async(retry=True)
                    break
                except Exception as e:  # noqa: BLE001 - the broker is being faulted
                    self.publish_errors += 1
                    self.log(f"publish of chord {item['callback_id']} failed ({e!r}); retrying")
                    time.sleep(0.5)
            for m in item["members"]:
                self._submitted({**m, "at": item["at"], "chord": item["callback_id"]})
            with self._submit_lock:
                self.chords.append(
                    Chord(item["callback_id"], tuple(m["task_id"] for m in item["members"]))
                )
        if the_plan:
            self.log(f"submitted {len(self.chords)} chords")

    def _submitted(self, item: dict[str, Any]) -> None:
        with self._submit_lock:
            self.submitted.append(item)
            with open(self.workdir / "submissions.jsonl", "a") as fh:
                fh.write(json.dumps({**item, "submitted": time.time()}) + "\n")

    def submit_probe(self, task_id: str, key: str) -> None:
        """A long outage's probe: ``chaos.probe`` on a key of its own (no contention),
        judged by the checker like every other task (policy ``exclusive``)."""
        self.tasks.probe.apply_async(args=(key, 0.05, -1), task_id=task_id)
        self._submitted(
            {
                "n": -1,
                "at": time.monotonic() - self.t0,
                "task_id": task_id,
                "key": key,
                "policy": "exclusive",
                "duration": 0.05,
                "probe": True,
            }
        )

    # -- settling ----------------------------------------------------------

    def broker_pending(self) -> int:
        c = self.cluster
        if c.broker_redis is not None:
            client = redis.Redis.from_url(c.env["CHAOS_BROKER"])
            try:
                n = sum(
                    int(client.llen(k))
                    for pattern in ("celery*", "chaos.probe*")
                    for k in client.scan_iter(match=pattern)
                    if client.type(k) == b"list"
                )
                # Not counted: messages kombu will restore only in ~1 h (their
                # unacked score came from a worker clock running an hour ahead).
                stranded = int(client.zcount("unacked_index", time.time() + 60, "+inf"))
                return n + int(client.hlen("unacked")) - stranded
            finally:
                client.close()
        assert c.rabbit is not None
        out = c.rabbit.ctl("list_queues", "name", "messages", "--quiet", "--no-table-headers")
        total = 0
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in ("celery", "chaos.probe"):
                total += int(parts[1])
        return total

    def settle(self, timeout: float) -> tuple[bool, int]:
        ids = [p["task_id"] for p in self.submitted] + [c.callback_id for c in self.chords]
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        stuck_since: float | None = None
        last_report = 0.0
        pending = len(ids)
        stall = stacks.Stall()
        while time.monotonic() < deadline:
            try:
                states = self.backend.states(ids)
                pending = sum(1 for t in ids if states.get(t, {}).get("status") not in FINAL)
                queued = self.broker_pending()
            except Exception as e:  # noqa: BLE001 - keep waiting through hiccups
                self.log(f"settle: {e!r}")
                time.sleep(2)
                continue
            if pending == 0 and queued == 0:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= 3.0:
                    self.log("settled")
                    return True, 0
            else:
                quiet_since = None
            # Nothing queued, nothing unacked, nothing running: what is not final
            # now never will be (lost); do not wait out the whole bound.
            if queued == 0 and pending > 0:
                stuck_since = stuck_since or time.monotonic()
                if time.monotonic() - stuck_since >= 20.0:
                    self.log(f"settle: {pending} task(s) not final and no message left; giving up")
                    return False, pending
            else:
                stuck_since = None
            if stall.still(pending, queued):
                # Messages held, nothing ending: a consumer that stopped. Its
                # stacks, once per stall, for whoever reads the run.
                where = self.workdir / "stacks"
                files = stacks.dump(self.cluster.all_workers(), where, stall.label)
                self.stalls.append({"pending": pending, "queued": queued, "stacks": len(files)})
                self.log(
                    f"settle: no progress for {stacks.STALL:.0f}s ({pending} not final, "
                    f"{queued} message(s) held): stacks in {where}"
                )
            if time.monotonic() - last_report > 10:
                self.log(f"settle: {pending} task(s) not final, {queued} message(s) in the broker")
                last_report = time.monotonic()
            time.sleep(1.0)
        self.log(f"settle timed out: {pending} task(s) not final")
        return False, pending

    # -- collecting -----------------------------------------------------------

    def collect(self) -> tuple[History, dict[str, Any]]:
        c = self.cluster
        subs = [Submission(p["task_id"], p["key"], p["policy"]) for p in self.submitted]
        self.clock.stop()
        (self.workdir / "clock.jsonl").write_text(
            "".join(json.dumps({"mono": m, "offset": o}) + "\n" for m, o in self.clock.samples)
        )
        attempts, events = read_history(c.history, self.clock.real)
        engine = create_engine(c.results_url)
        with engine.connect() as conn:
            accepted = [
                Accepted(
                    r.lease_key,
                    int(r.fencing_token),
                    r.task_id,
                    float(r.accepted_at),
                    r.id,
                    r.result,
                )
                for r in conn.execute(
                    text(
                        "SELECT id, lease_key, fencing_token, task_id, accepted_at, result "
                        "FROM celery_lease_results ORDER BY id"
                    )
                )
            ]
            protected = [
                Protected(r.key, int(r.token), r.task_id, float(r.written_at), r.id)
                for r in conn.execute(
                    text(
                        "SELECT id, key, token, task_id, written_at "
                        "FROM chaos_protected ORDER BY id"
                    )
                )
            ]
            ended = {
                r.task_id: int(r.fencing_token)
                for r in conn.execute(text("SELECT task_id, fencing_token FROM celery_lease_ended"))
            }
        engine.dispose()
        raw = self.backend.states([s.task_id for s in subs])
        self.backend_history = self.backend.history()
        backend = {tid: backends.backend_of(meta) for tid, meta in raw.items()}
        extra: dict[str, Any] = {"events": events}
        transport_lost: dict[str, str] = {}
        if c.broker_redis is not None:
            files, base_empty = aof.aof_files(c.broker_redis.data_dir)
            blog = aof.analyze(
                files, base_empty=base_empty, now=time.time(), visibility_timeout=self.opts.vt
            )
            transport_lost = blog.transport_lost()
            extra.update(
                transport_lost_messages=len(blog.lost_messages),
                transport_stranded_messages=len(blog.stranded),
                aof_commands=blog.commands,
                aof_complete=blog.complete and not blog.divergent,
                broker_queued_at_end=blog.queued_at_end,
                broker_unacked_at_end=blog.unacked_at_end,
            )
        extra["log_counts"] = count_log_states(c.logdir)
        extra["supervisor_restarts"] = c.supervisor_restarts
        extra["liveness_restarts"] = c.liveness_restarts
        extra["publish_errors"] = self.publish_errors
        callbacks = self.backend.states([c.callback_id for c in self.chords])
        history = History(
            chords=list(self.chords),
            callbacks={tid: backends.backend_of(meta) for tid, meta in callbacks.items()},
            collected=read_collected(c.history),
            submissions=subs,
            attempts=attempts,
            accepted=accepted,
            protected=protected,
            backend=backend,
            transport_lost=transport_lost,
            broker=self.opts.broker,
            backend_history=self.backend_history,
            ended=ended,
        )
        return history, extra

    def figures(
        self, report: Report, injector: Injector, extra: dict[str, Any], settled: bool
    ) -> dict[str, Any]:
        f: dict[str, Any] = {
            "broker": self.opts.broker,
            "backend": self.opts.backend,
            "store": self.opts.store,
            "seed": self.opts.seed,
            "duration_s": self.opts.duration,
            "workers": f"{self.opts.workers} (w0 -P threads, others prefork)"
            f" x {self.opts.concurrency}",
        }
        f.update(report.figures)
        f["faults"] = {k: injector.counts.get(k, 0) for k in self.opts.kinds}
        f["faults_total"] = sum(injector.counts.values())
        f["faults_failed"] = dict(injector.failed)
        counts = extra["log_counts"]
        f["deferrals"] = counts.get("LEASE_DEFERRED", 0)
        f["rejections"] = counts.get("LEASE_REJECTED", 0)
        f["fenced_commits"] = counts.get("FENCED", 0)
        f["leases_lost"] = counts.get("LEASE_LOST", 0)
        f["prerun"] = extra["events"].get("prerun", 0)
        f["supervisor_restarts"] = extra["supervisor_restarts"]
        f["liveness_restarts"] = extra["liveness_restarts"]
        f["publish_retries"] = extra["publish_errors"]
        if "transport_lost_messages" in extra:
            f["broker_messages_lost"] = extra["transport_lost_messages"]
            f["broker_messages_stranded"] = extra["transport_stranded_messages"]
            f["broker_aof_commands"] = extra["aof_commands"]
            f["broker_aof_complete"] = extra["aof_complete"]
        f["settled"] = settled
        if self.chords:
            f["chords_recovered"] = count_recovered(self.cluster.logdir)
        writes = [b for bs in (self.backend_history or {}).values() for b in bs]
        f["backend_writes"] = len(writes)
        f["backend_writes_tokened"] = sum(1 for b in writes if b.token is not None)
        f["settle_stalls"] = len(self.stalls)
        f["violations"] = len(report.violations)
        f["violations_by_kind"] = dict(report.by_kind())
        return f


def run(opts: Options) -> RunResult:
    return Run(opts).execute()
