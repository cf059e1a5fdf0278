"""Assemble ``docs/benchmarks.md`` from the fragments the benchmark scripts write.

Each script writes ``benchmarks/results/<name>.json`` (the data) and ``<name>.md`` (its section);
this file only concatenates the sections in a fixed order, so one benchmark can be rerun alone.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ORDER = ("plan_compare", "plan_compare_memory", "branch_scaling", "search_speed", "step_time", "overhead", "action_cost", "compute_stack", "compute_stack_sleeping", "activation_meter",
         "stage_switch", "schedules", "peers", "gc_pauses", "zbv_in_flight", "zbv_order", "fanin", "async_convergence", "planned_runs", "device_profiles", "large_models",
         "zero_memory", "tp_memory", "tp_planning", "checkpoint_save",
         "elastic_recovery")

HEADER = """# Benchmarks

Regenerate everything with `make bench`; each script can also be run alone
(`python benchmarks/<name>.py`, then `python benchmarks/report.py`). The data behind every table is
in `benchmarks/results/<name>.json`.
"""


def notes(name: str) -> str:
    """The hand-written reading of a section, ``benchmarks/results/<name>_notes.md`` (what its
    tables say, kept apart from what the script regenerates), or ``""`` if it has none."""
    path = RESULTS / f"{name}_notes.md"
    return path.read_text() if path.exists() else ""


def main() -> None:
    sections = [HEADER]
    for name in ORDER:
        fragment = RESULTS / f"{name}.md"
        if fragment.exists():
            sections.append(fragment.read_text().strip() + "\n")
    (ROOT / "docs" / "benchmarks.md").write_text("\n".join(sections))
    print(f"wrote {ROOT / 'docs' / 'benchmarks.md'}")


if __name__ == "__main__":
    main()
