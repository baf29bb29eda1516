"""Prometheus text from every replica merged into one exposition, each series labelled (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

REPLICA_LABEL = "replica"


@dataclass
class _Family:
    """One metric family while merging: its HELP/TYPE lines once, samples from every replica."""

    name: str
    help_line: str | None = None
    type_line: str | None = None
    samples: list[str] = field(default_factory=list)


def label_sample(line: str, replica: str) -> str:
    """`name{a="b"} 1` -> `name{replica="0",a="b"} 1`; `name 1` -> `name{replica="0"} 1`."""
    brace = line.find("{")
    space = line.find(" ")
    label = f'{REPLICA_LABEL}="{replica}"'
    if brace != -1 and (space == -1 or brace < space):
        inner = line[brace + 1 :]
        separator = "" if inner.lstrip().startswith("}") else ","
        return f"{line[: brace + 1]}{label}{separator}{inner}"
    return f"{line[:space]}{{{label}}}{line[space:]}"


def _sample_name(line: str) -> str:
    end = min((i for i in (line.find("{"), line.find(" ")) if i != -1), default=len(line))
    return line[:end]


def merge_expositions(texts: dict[str, str]) -> str:
    """replica label -> its /metrics text, merged: families in first-seen order, each family's
    HELP/TYPE once, then every replica's samples with a `replica` label added.

    Samples follow the family their `# TYPE` line opened (histogram `_bucket`/`_sum`/`_count`
    included); a sample outside any announced family becomes its own untyped family.
    """
    families: dict[str, _Family] = {}
    for replica, text in texts.items():
        current: _Family | None = None
        for raw in text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(maxsplit=3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = families.setdefault(parts[2], _Family(parts[2]))
                    attribute = "help_line" if parts[1] == "HELP" else "type_line"
                    if getattr(current, attribute) is None:
                        setattr(current, attribute, line)
                continue
            name = _sample_name(line)
            if current is None or not name.startswith(current.name):
                current = families.setdefault(name, _Family(name))
            current.samples.append(label_sample(line, replica))
    out: list[str] = []
    for family in families.values():
        out += [line for line in (family.help_line, family.type_line) if line]
        out += family.samples
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class CounterFamily:
    """One of the proxy's own metric families: per-replica values (None key = no label)."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    values: dict[str | None, float]

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for replica, value in self.values.items():
            labels = "" if replica is None else f'{{{REPLICA_LABEL}="{replica}"}}'
            lines.append(f"{self.name}{labels} {value:g}")
        return "\n".join(lines) + "\n"
