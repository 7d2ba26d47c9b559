"""The end-of-session table of ``pytest perf/``: one row per benchmark case, targets last.

Benchmarks add rows (:meth:`PerfReport.add`) with raw numbers; ``perf/conftest.py`` prints
:meth:`PerfReport.lines` in pytest's terminal summary and, when ``PAGED_SERVE_PERF_JSON`` names
a file, writes :meth:`PerfReport.to_json` there (``ci/gpu-check.sh`` reads it).

Column formats follow the metric's name: ``*_us`` microseconds, ``*_x`` ratios (``1.23x``),
``*_pct`` percentages, ``gbps`` / ``tflops`` rates. Targets are the speed each benchmark aims
for (the module that adds the row sets the goal), reported as met / not met and never asserted:
a benchmark is a measurement, not a test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Target:
    """A goal on one metric of one case: ``value >= goal``."""

    name: str
    value: float | None
    goal: float
    unit: str  # "%" or "x"

    @property
    def met(self) -> bool | None:
        return None if self.value is None else self.value >= self.goal

    def describe(self) -> str:
        value = "n/a" if self.value is None else f"{self.value:.2f}{self.unit}"
        verdict = {True: "met", False: "NOT met", None: "not measured"}[self.met]
        return f"{self.name}: {value} (goal >= {self.goal:g}{self.unit}) {verdict}"


@dataclass(slots=True)
class PerfRow:
    section: str
    case: str
    metrics: dict[str, float | str | None]
    targets: list[Target] = field(default_factory=list)


def format_metric(name: str, value: float | str | None) -> str:
    """Format a metric by its name's suffix (see the module docstring)."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if name.endswith("_x"):
        return f"{value:.2f}x"
    if name.endswith("_pct"):
        return f"{value:.0f}%"
    if name.endswith("_us"):
        return f"{value:.1f}" if value < 1000 else f"{value:.0f}"
    if name.endswith("tflops"):
        return f"{value:.1f}"
    if name.endswith("gbps"):
        return f"{value:.0f}"
    return f"{value:.4g}"


def _join(cells: list[str], widths: list[int]) -> str:
    """The first cell left-aligned, the others right-aligned."""
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )


class PerfReport:
    """Rows collected during a ``pytest perf/`` session."""

    def __init__(self) -> None:
        self.rows: list[PerfRow] = []
        self.sections: dict[str, str] = {}  # section -> title, in first-seen order
        self.notes: list[str] = []

    def add(
        self,
        section: str,
        case: str,
        metrics: dict[str, float | str | None],
        *,
        title: str | None = None,
        targets: list[Target] | tuple[Target, ...] = (),
    ) -> None:
        self.sections.setdefault(section, title or section)
        self.rows.append(PerfRow(section, case, dict(metrics), list(targets)))

    @property
    def targets(self) -> list[tuple[str, Target]]:
        return [(row.case, t) for row in self.rows for t in row.targets]

    def lines(self) -> list[str]:
        """The table: one block per section, then notes, then every target."""
        out: list[str] = []
        for section, title in self.sections.items():
            rows = [r for r in self.rows if r.section == section]
            columns: list[str] = []
            for r in rows:
                columns += [c for c in r.metrics if c not in columns]
            cells = [[r.case] + [format_metric(c, r.metrics.get(c)) for c in columns] for r in rows]
            header = ["case", *columns]
            widths = [max(len(x) for x in col) for col in zip(header, *cells)]
            out.append(f"-- {title}")
            out += [_join(line, widths) for line in [header, *cells]]
        out += [f"note: {n}" for n in self.notes]
        if self.targets:
            out.append("-- targets (reported, never asserted)")
            out += [f"{case}  {t.describe()}" for case, t in self.targets]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "sections": self.sections,
            "rows": [
                {"section": r.section, "case": r.case, "metrics": r.metrics} for r in self.rows
            ],
            "targets": [
                {
                    "case": case,
                    "name": t.name,
                    "value": t.value,
                    "goal": t.goal,
                    "unit": t.unit,
                    "met": t.met,
                }
                for case, t in self.targets
            ],
            "notes": self.notes,
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")
