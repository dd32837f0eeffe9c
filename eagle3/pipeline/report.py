"""A run's summary: key stats from the manifests and the stages' plots, as Markdown or HTML.

Plots are the PNGs the stages committed (vocab ``coverage.png``, train ``loss.png``,
evaluate ``acceptance.png``), each with a band naming the run stamped above it; they are
copied next to the Markdown file, or embedded in the HTML file so it can be mailed as one file.
"""

from __future__ import annotations

import base64
import html as htmlmod
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.manifest import read_manifest, verify_stage
from eagle3.pipeline.runstate import run_dir
from eagle3.runs import open_run_store, require_run
from eagle3.stages import ORDER, STAGES
from eagle3.store import ObjectStore

STAMP_BAND = 26  # pixels of the band naming the run above each plot
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
    """Where the exported drafter lives, as the export manifest names it: a local folder for
    file://, else the store URI. The folder changes with each export attempt; ``eagle3ctl show
    drafter`` prints it for the run at any time."""
    store = store or open_run_store(cfg, create=False)
    loaded = read_manifest(store, cfg.run_id, "export")
    prefix = loaded.manifest.prefix if loaded else f"{cfg.run_id}/export"
    local = store.local_path(f"{prefix}/config.json")
    return str(local.parent) if local is not None else f"{store.uri}/{prefix}/"


MAL_DEFINITION = ("tokens the target accepts per verification step, counting the one token the target adds "
                  "itself (the bonus token): 1 + the accepted draft tokens, between 1 and k + 1")


def acceptance_line(evaluation: dict[str, Any] | None) -> str | None:
    """``mean acceptance length 2.85 at k=3: 1 (the target's bonus token) + 0.72 + 0.60 + 0.54 (…)``."""
    if not evaluation or evaluation.get("mean_acceptance_length") is None:
        return None
    k = evaluation.get("num_draft_tokens")
    rates = evaluation.get("acceptance_rate_per_position") or {}
    cumulative = rates.get("cumulative") if isinstance(rates, dict) else rates
    per = "".join(f" + {r:.2f}" for r in cumulative or [])
    parts = f": 1 (the target's bonus token){per} (drafts accepted at positions 1..{len(cumulative)})" if per else ""
    return f"mean acceptance length {evaluation['mean_acceptance_length']:.3g} at k={k}{parts}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        s = json.dumps(v, separators=(", ", ": "))
        return s if len(s) <= 100 else s[:97] + "..."
    return str(v)


def collect(cfg: PipelineConfig, store: ObjectStore, out_dir: Path) -> list[StageSummary]:
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
            s.plot.write_bytes(stamp(store.get_bytes(m.object_key(PLOTS[name][0])), f"run {cfg.run_id}: {PLOTS[name][1]}"))
        out.append(s)
    return out


def stamp(png: bytes, caption: str) -> bytes:
    """The plot with a band above it naming the run, so a plot seen alone still says whose it is."""
    import io

    from PIL import Image, ImageDraw, ImageFont

    image = Image.open(io.BytesIO(png)).convert("RGB")
    try:
        font: Any = ImageFont.load_default(size=14)
    except (TypeError, OSError):  # a Pillow without FreeType: its bitmap font
        font = ImageFont.load_default()
    out = Image.new("RGB", (image.width, image.height + STAMP_BAND), "white")
    out.paste(image, (0, STAMP_BAND))
    ImageDraw.Draw(out).text((8, 5), caption, fill="black", font=font)
    buf = io.BytesIO()
    out.save(buf, format="PNG")
    return buf.getvalue()


def evaluation_report(cfg: PipelineConfig, store: ObjectStore) -> dict[str, Any] | None:
    """The evaluate stage's ``report.json``, when the stage is complete."""
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


def to_markdown(cfg: PipelineConfig, summaries: list[StageSummary], evaluation: dict[str, Any] | None,
                drafter: str | None, store_uri: str) -> str:
    lines = [f"# EAGLE-3 drafter run `{cfg.run_id}`", "",
             f"- target: `{cfg.target.model}`", f"- store: `{store_uri}`",
             f"- drafter: `{drafter}`" if drafter else "- drafter: not exported yet", ""]
    if evaluation:
        k = evaluation.get("num_draft_tokens")
        lines += ["## Acceptance", "",
                  f"Mean acceptance length: **{_fmt(evaluation.get('mean_acceptance_length'))}** with k = {k} draft "
                  f"tokens per verification step.", "",
                  f"Mean acceptance length: {MAL_DEFINITION}. Per position i, _cumulative_ is the share of steps "
                  f"that accepted drafts 1..i (the mean acceptance length is 1 + their sum), _conditional_ the "
                  f"share that accepted draft i given drafts 1..i-1 were.", ""]
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
            lines += [f"![run {cfg.run_id}: {PLOTS[s.name][1]}]({s.plot.name})", ""]
    return "\n".join(lines)


def to_html(markdown: str, out_dir: Path, title: str) -> str:
    """A small Markdown subset (headings, tables, bullets, images) to one self-contained page."""
    body, in_table, in_list = [], False, False
    for line in markdown.splitlines():
        if in_list and not line.startswith("- "):
            body.append("</ul>")
            in_list = False
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
            body.append(f'<figure><img alt="{htmlmod.escape(alt)}" src="data:image/png;base64,{data}" '
                        f'style="max-width:720px"><figcaption>{htmlmod.escape(alt)}</figcaption></figure>')
        elif line.startswith("## "):
            body.append(f"<h2>{_inline(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{_inline(line[2:])}</h1>")
        elif line.startswith("- "):
            body.append(("<ul>" if not in_list else "") + f"<li>{_inline(line[2:])}</li>")
            in_list = True
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
    body += ["</table>"] if in_table else []
    body += ["</ul>"] if in_list else []
    style = "body{font-family:sans-serif;max-width:900px;margin:2em auto}td{border:1px solid #ccc;padding:2px 8px}"
    head = f"<meta charset='utf-8'><title>{htmlmod.escape(title)}</title><style>{style}</style>"
    return f"<!doctype html>\n<html lang='en'><head>{head}</head><body>\n" + "\n".join(body) + "\n</body></html>\n"


def _inline(text: str) -> str:
    import re

    t = htmlmod.escape(text)
    t = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", t)
    t = re.sub(r"`(.+?)`", r"<code>\1</code>", t)
    return re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"<i>\1</i>", t)


def build_report(cfg: PipelineConfig, out_dir: Path | None = None, html: bool = False) -> Path:
    """Write the report (report.md or report.html) and its plots; return its path."""
    store = open_run_store(cfg, create=False)
    require_run(store, cfg.run_id)
    out_dir = out_dir or run_dir(cfg.run_id, store.uri) / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = collect(cfg, store, out_dir)
    exported = any(s.name == "export" and s.complete for s in summaries)
    md = to_markdown(cfg, summaries, evaluation_report(cfg, store), drafter_location(cfg, store) if exported else None,
                     store.uri)
    path = out_dir / ("report.html" if html else "report.md")
    path.write_text(to_html(md, out_dir, f"EAGLE-3 drafter run {cfg.run_id}") if html else md + "\n")
    return path.resolve()
