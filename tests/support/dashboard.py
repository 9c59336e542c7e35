"""The Grafana dashboard's queries, and the metric names and labels each one uses."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "dashboards"
DASHBOARD = DASHBOARD / "hma-redis.json"
_METRIC = re.compile(r"vllm:[A-Za-z0-9_:]+")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
# Labels PromQL or Prometheus adds, not the exporter.
_NOT_EXPORTED = {"le", "instance", "job"}


@dataclass(frozen=True)
class Query:
    panel: str
    expr: str

    @property
    def metrics(self) -> set[str]:
        """Every metric name the query reads (``vllm:...``, as a scrape shows it)."""
        return set(_METRIC.findall(self.expr))

    @property
    def grouped_by(self) -> set[str]:
        """The exporter's labels the query groups by (``sum by (kind)``)."""
        labels = {x.strip() for group in _BY.findall(self.expr) for x in group.split(",")}
        return labels - _NOT_EXPORTED - {""}


def dashboard_queries(path: Path = DASHBOARD) -> list[Query]:
    """Every panel target's query, and the template variables' queries."""
    data = json.loads(path.read_text())
    out = [
        Query(panel["title"], target["expr"])
        for panel in data["panels"]
        for target in panel.get("targets", [])
    ]
    for variable in data["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            out.append(Query(f"variable {variable['name']}", query["query"]))
    return out
