"""The markdown of BENCHMARKS.md: tables, sections and target verdicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    align: str = ""  # one char per column: l or r

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        align = self.align or ("l" + "r" * (len(self.columns) - 1))
        sep = ["---:" if a == "r" else "---" for a in align]
        out = ["| " + " | ".join(self.columns) + " |", "| " + " | ".join(sep) + " |"]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(out)


@dataclass
class Section:
    """One benchmark's part of BENCHMARKS.md."""

    name: str
    title: str
    intro: str = ""
    blocks: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: one-line headline results for the summary at the top of BENCHMARKS.md
    summary: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.blocks.append(text.strip("\n"))

    def markdown(self) -> str:
        parts = [f"## {self.title}", ""]
        if self.intro:
            parts += [self.intro.strip(), ""]
        for b in self.blocks:
            parts += [b, ""]
        parts.append(f"_Benchmark wall time: {self.seconds:.1f} s._")
        return "\n".join(parts)


def mark(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "missed")


def target_line(met: bool | None, text: str) -> str:
    shown = mark(met) if met is None else f"**{mark(met)}**"
    return f"Target: {text}: {shown}."
