"""Render a Grafana dashboard of deploy/grafana/dashboards to a PNG without Grafana: each
panel's own PromQL, asked of a real Prometheus, drawn where the panel's gridPos puts it.

    .venv/bin/python scripts/render_dashboard.py deploy/grafana/dashboards/loop.json \\
        http://127.0.0.1:9090 reports/loop-dashboard.png --minutes 10

For a look at the dashboards where no Grafana can run (no registry this project installs from
has one): the queries, units and layout are the dashboard's; the styling is matplotlib's.
Stat panels show the instant value; time series the range at a 5-second step, with
``$__rate_interval`` taken as 1m. A panel whose queries return nothing says so.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen

COLUMNS = 24
RATE_INTERVAL = "1m"


def query(prometheus: str, path: str, **params: Any) -> list[dict]:
    url = f"{prometheus.rstrip('/')}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as response:
        document = json.load(response)
    if document.get("status") != "success":
        raise RuntimeError(f"{url}: {document}")
    return document["data"]["result"]


def legend(target: dict, labels: dict[str, str]) -> str:
    """The target's legendFormat with {{label}} filled in, or the labels themselves."""
    fmt = target.get("legendFormat", "")
    if fmt and fmt != "__auto":
        for name, value in labels.items():
            fmt = fmt.replace("{{" + name + "}}", value).replace("{{ " + name + " }}", value)
        return fmt
    shown = {k: v for k, v in labels.items() if k not in ("job", "instance", "__name__")}
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or target.get("expr", "")[:40]


def draw_panel(ax, panel: dict, prometheus: str, start: float, end: float) -> None:
    ax.set_title(panel.get("title", ""), fontsize=8, loc="left")
    ax.tick_params(labelsize=6)
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    drawn = 0
    for target in panel.get("targets", []):
        expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL)
        if panel["type"] == "stat":
            for series in query(prometheus, "query", query=expr, time=end)[:1]:
                value = float(series["value"][1])
                text = f"{value:.0%}" if unit == "percentunit" else f"{value:,.4g}"
                ax.text(
                    0.5, 0.4, text, ha="center", va="center", fontsize=20, transform=ax.transAxes
                )
                drawn += 1
            continue
        for series in query(prometheus, "query_range", query=expr, start=start, end=end, step=5):
            t = [(float(x) - end) / 60 for x, _ in series["values"]]
            y = [float(v) for _, v in series["values"]]
            ax.plot(t, y, linewidth=1, label=legend(target, series["metric"])[:40])
            drawn += 1
    if panel["type"] == "stat":
        ax.set_xticks([])
        ax.set_yticks([])
    elif drawn:
        ax.set_xlabel("minutes ago", fontsize=6)
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        if drawn <= 8:
            ax.legend(fontsize=5, loc="upper left")
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", color="grey", transform=ax.transAxes)


def render(
    dashboard: dict, prometheus: str, out: Path, minutes: float, end: float | None = None
) -> Path:
    panels = dashboard["panels"]
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    figure = plt.figure(figsize=(16, height * 0.28))
    grid = figure.add_gridspec(height, COLUMNS, hspace=1.2, wspace=1.2, top=0.965, bottom=0.03)
    end = time.time() if end is None else end
    for panel in panels:
        pos = panel["gridPos"]
        if panel["type"] == "row":
            ax = figure.add_subplot(grid[pos["y"], :])
            ax.axis("off")
            ax.text(0, 1.0, panel.get("title", ""), fontsize=10, weight="bold", va="bottom")
            continue
        ax = figure.add_subplot(
            grid[pos["y"] : pos["y"] + pos["h"], pos["x"] : pos["x"] + pos["w"]]
        )
        draw_panel(ax, panel, prometheus, end - minutes * 60, end)
    figure.suptitle(f"{dashboard['title']}: the last {minutes:g} minutes", fontsize=12)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dashboard", type=Path)
    parser.add_argument("prometheus", help="base URL of a Prometheus, e.g. http://127.0.0.1:9090")
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--end", type=float, help="unix time the window ends (default: now)")
    args = parser.parse_args()
    dashboard = json.loads(args.dashboard.read_text())
    print(render(dashboard, args.prometheus, args.out, args.minutes, args.end))


if __name__ == "__main__":
    main()
