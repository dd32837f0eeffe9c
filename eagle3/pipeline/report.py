"""A run's summary: key stats from the manifests and the stages' plots, as Markdown or HTML.

Plots are the PNGs the stages committed (vocab ``coverage.png``, train ``loss.png``,
evaluate ``acceptance.png``); they are copied next to the Markdown file, or embedded in
the HTML file so it can be mailed as one file.
"""

from __future__ import annotations

import base64
import html as htmlmod
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.context import open_run_store
from eagle3.manifest import read_manifest, verify_stage
from eagle3.pipeline.runstate import run_dir
from eagle3.stages import ORDER, STAGES
from eagle3.store import ObjectStore

PLOTS = {"vocab": ("coverage.png", "Draft-vocab coverage"), "train": ("loss.png", "Training loss"),
         "evaluate": ("acceptance.png", "Acceptance per position")}


@dataclass
class StageSummary:
    name: str
    complete: bool
    reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    finished_at: str | None = None
    plot: Path | None = None


def drafter_location(cfg: PipelineConfig, store: ObjectStore | None = None) -> str:
    """Where the exported drafter lives: a local folder for file://, else the store URI."""
    store = store or open_run_store(cfg)
    loaded = read_manifest(store, cfg.run_id, "export")
    prefix = loaded.manifest.prefix if loaded else f"{cfg.run_id}/export"
    local = store.local_path(f"{prefix}/config.json")
    return str(local.parent) if local is not None else f"{store.uri}/{prefix}/"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        s = json.dumps(v, separators=(", ", ": "))
        return s if len(s) <= 100 else s[:97] + "..."
    return str(v)


def collect(cfg: PipelineConfig, out_dir: Path) -> list[StageSummary]:
    store = open_run_store(cfg)
    out = []
    for name in ORDER:
        v = verify_stage(store, cfg.run_id, name)
        if v.manifest is None or not v.complete:
            out.append(StageSummary(name, False, v.reason))
            continue
        m = v.manifest.manifest
        s = StageSummary(name, True, "complete", m.stats, m.finished_at)
        if name in PLOTS and PLOTS[name][0] in m.keys():
            s.plot = out_dir / f"{name}-{PLOTS[name][0]}"
            s.plot.write_bytes(store.get_bytes(m.object_key(PLOTS[name][0])))
        out.append(s)
    return out


def _evaluation(cfg: PipelineConfig) -> dict[str, Any] | None:
    store = open_run_store(cfg)
    v = verify_stage(store, cfg.run_id, "evaluate")
    if not v.complete or v.manifest is None or "report.json" not in v.manifest.manifest.keys():
        return None
    return json.loads(store.get_bytes(v.manifest.manifest.object_key("report.json")))


def _rates_table(rates: Any) -> list[str]:
    """Acceptance per draft position: a list, or named lists (e.g. conditional / cumulative)."""
    if not rates:
        return []
    columns = rates if isinstance(rates, dict) else {"acceptance rate": rates}
    columns = {k: v for k, v in columns.items() if isinstance(v, list)}
    if not columns:
        return []
    n = max(len(v) for v in columns.values())
    lines = ["| position | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for i in range(n):
        lines.append(f"| {i + 1} | " + " | ".join(_fmt(v[i]) if i < len(v) else "" for v in columns.values()) + " |")
    return lines + [""]


def to_markdown(cfg: PipelineConfig, summaries: list[StageSummary], evaluation: dict[str, Any] | None) -> str:
    exported = any(s.name == "export" and s.complete for s in summaries)
    lines = [f"# EAGLE-3 drafter run `{cfg.run_id}`", "",
             f"- target: `{cfg.target.model}`", f"- store: `{cfg.store.uri}`",
             f"- drafter: `{drafter_location(cfg)}`" if exported else "- drafter: not exported yet", ""]
    if evaluation:
        lines += ["## Acceptance", "", f"Mean acceptance length: **{_fmt(evaluation.get('mean_acceptance_length'))}**", ""]
        lines += _rates_table(evaluation.get("acceptance_rate_per_position"))
    for s in summaries:
        lines += [f"## {s.name}", "", f"_{STAGES[s.name].description}_", ""]
        if not s.complete:
            lines += [f"Not complete: {s.reason}", ""]
            continue
        lines += [f"Finished {s.finished_at}.", "", "| stat | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v).replace('|', '/')} |" for k, v in s.stats.items()]
        lines.append("")
        if s.plot is not None:
            lines += [f"![{PLOTS[s.name][1]}]({s.plot.name})", ""]
    return "\n".join(lines)


def to_html(markdown: str, out_dir: Path) -> str:
    """A small Markdown subset (headings, tables, bullets, images) to one self-contained page."""
    body, in_table = [], False
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-"):
                continue
            body.append(("<table>" if not in_table else "") + "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in cells) + "</tr>")
            in_table = True
            continue
        if in_table:
            body.append("</table>")
            in_table = False
        if line.startswith("!["):
            alt, src = line[2:].split("](")
            data = base64.b64encode((out_dir / src.rstrip(")")).read_bytes()).decode()
            body.append(f'<img alt="{htmlmod.escape(alt)}" src="data:image/png;base64,{data}" style="max-width:720px">')
        elif line.startswith("## "):
            body.append(f"<h2>{_inline(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{_inline(line[2:])}</h1>")
        elif line.startswith("- "):
            body.append(f"<li>{_inline(line[2:])}</li>")
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
    if in_table:
        body.append("</table>")
    style = "body{font-family:sans-serif;max-width:900px;margin:2em auto}td{border:1px solid #ccc;padding:2px 8px}"
    return f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"


def _inline(text: str) -> str:
    import re

    t = htmlmod.escape(text)
    t = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)
    t = re.sub(r"`(.+?)`", r"<code>\1</code>", t)
    return re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"<i>\1</i>", t)


def build_report(cfg: PipelineConfig, out_dir: Path | None = None, html: bool = False) -> Path:
    """Write the report (report.md or report.html) and its plots; return its path."""
    from eagle3.pipeline.status import require_run

    require_run(open_run_store(cfg), cfg.run_id)
    out_dir = out_dir or run_dir(cfg.run_id) / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    md = to_markdown(cfg, collect(cfg, out_dir), _evaluation(cfg))
    path = out_dir / ("report.html" if html else "report.md")
    path.write_text(to_html(md, out_dir) if html else md + "\n")
    return path.resolve()
