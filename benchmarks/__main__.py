"""``python -m benchmarks [--quick] [--only NAME] [--out BENCHMARKS.md]``: run, report, write."""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.env import ROOT, Env, log, machine, start_env
from benchmarks.report import Section

#: module names, in the order they run and appear in BENCHMARKS.md
BENCHMARKS = [
    "primitives", "per_task", "round_trips", "renewal", "contention", "growth", "memory",
    "redis_ha", "backends",
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="celery-lease benchmarks: cost per lease operation and per task, "
        "side by side with the peers, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds (~1 min)")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run only these benchmarks (repeatable or comma-separated): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument("--out", default="BENCHMARKS.md", help="where to write the report")
    parser.add_argument(
        "--redis-url",
        help="use this Redis (redis://host:port/N: databases N, N+1, ... are flushed and used) "
        "instead of starting private servers",
    )
    parser.add_argument(
        "--pg-url",
        help="use this PostgreSQL server (a URL to a database the user may CREATE DATABASE "
        "from) instead of a private cluster",
    )
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temporary directory")
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="rounds for the drain sections (2 and 9) instead of their default (3): more "
        "rounds narrow a head-to-head ratio on a noisy machine",
    )
    parser.add_argument(
        "--contenders",
        default="",
        metavar="KEYS",
        help="section 2 runs only these contenders, comma-separated (plain, the baseline, "
        "always), without its profiles and statement timings: a head-to-head, e.g. "
        "once,singleton,leased-redis-nocommit",
    )
    args = parser.parse_args(argv)
    from benchmarks.workers import FLOORS, KINDS

    known = [k.key for k in (*KINDS, *FLOORS)]
    contenders = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
    if [c for c in contenders if c not in known]:
        parser.error(f"unknown contender(s) in --contenders; known: {', '.join(known)}")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    only = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = [n for n in only if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {BENCHMARKS}")
    selected = [n for n in BENCHMARKS if not only or n in only]

    command = _command(argv)
    revision = _revision()
    started = time.monotonic()
    tmpdir = Path(tempfile.mkdtemp(prefix="celery-lease-bench-"))
    os.chmod(tmpdir, 0o755)
    host = machine()
    log(f"starting servers in {tmpdir}")
    env = start_env(tmpdir, args.quick, args.redis_url, args.pg_url)
    env.rounds, env.contenders = args.rounds, contenders
    sections: list[Section] = []
    failed: list[str] = []
    out = Path(args.out)
    try:
        for name in selected:
            module = importlib.import_module(f"benchmarks.{name}")
            log(f"== {module.TITLE}")
            t0 = time.monotonic()
            try:
                section = module.run(env)
            except Exception:  # noqa: BLE001 - recorded in the report, exit status 1
                failed.append(name)
                err = traceback.format_exc()
                log(f"{name} FAILED:\n{err}")
                section = Section(name, module.TITLE)
                section.add(f"**This benchmark failed:**\n\n```\n{err}```")
            section.seconds = time.monotonic() - t0
            log(f"== {name} done in {section.seconds:.1f} s")
            sections.append(section)
            _write(out, command, host, env, sections, time.monotonic() - started, args.quick,
                   revision)  # fmt: skip
    finally:
        env.close()
        if not args.keep_tmp:
            shutil.rmtree(tmpdir, ignore_errors=True)
    total = time.monotonic() - started
    _write(out, command, host, env, sections, total, args.quick, revision, done=True)
    log(f"wrote {out} ({total:.1f} s)")
    return 1 if failed else 0


def _revision() -> str:
    """The commit, and the product files that differ from it (the working tree is measured)."""
    import subprocess

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False)
        return r.stdout.rstrip("\n")

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    changed = [line[3:] for line in git("status", "--porcelain", "--", "celery_lease",
                                          "migrations").splitlines()]  # fmt: skip
    text = f"commit `{head}`"
    if changed:
        text += " with uncommitted changes to " + ", ".join(f"`{c}`" for c in changed)
    return text


def _command(argv: list[str] | None) -> str:
    exe = Path(sys.executable)
    try:
        shown = str(exe.relative_to(Path.cwd()))
    except ValueError:
        shown = str(exe)
    return shlex.join([shown, "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)])


def _write(
    out: Path,
    command: str,
    host: dict[str, str],
    env: Env,
    sections: list[Section],
    seconds: float,
    quick: bool,
    revision: str,
    done: bool = False,
) -> None:
    lines = [
        "# celery-lease benchmarks",
        "",
        "Cost per lease operation and per task, side by side with the peers, in one run.",
        "Generated by `benchmarks/` (do not edit by hand; re-run the command below).",
        "Every benchmark interleaves its contenders (A, B, A, B, …) and reports medians and",
        "ratios to a baseline measured in the same run: the machine is shared, so absolute",
        "numbers drift and only same-run ratios compare. Nothing here asserts anything",
        "about speed.",
        "",
        f"Command: `{command}` (run from the repository root"
        + (", quick pass" if quick else ", full run")
        + ")",
        "",
        f"Total wall time: {seconds:.0f} s" + ("" if done else " (still running)") + ".",
        "",
        f"Product measured: {revision}.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in host.items()]
    lines += [f"| {k} | {v} |" for k, v in env.versions.items()]
    lines += [
        "| servers | "
        + (
            "private, started by `tests/servers/`: two Redis (broker; lease store and the "
            "peers' locks), no persistence; one PostgreSQL cluster (fsync off, "
            "synchronous_commit on, pg_stat_statements)"
            if env.servers
            else "given by --redis-url / --pg-url"
        )
        + " |",
        "",
    ]
    summary = [s for sec in sections for s in sec.summary]
    if summary:
        lines += ["## Summary", ""] + [f"- {s}" for s in summary] + [""]
    for sec in sections:
        lines += [sec.markdown(), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("\n".join(lines))
    tmp.replace(out)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
