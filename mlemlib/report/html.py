"""The summary as HTML pages: ``summary.html`` from ``summary.md``, ``runs.html`` from the rows (host; Python-Markdown).

The Snakemake report shows HTML files (in a frame) and images; a CSV or
Markdown result is only offered as a link that browsers open blank. So the
tables go into the report as HTML: :func:`markdown_page` renders the
summary's Markdown with the ``markdown`` package (pipe tables as tables,
raw HTML in the text escaped, local images embedded as data URIs so that
the page shows its plots wherever it is opened, and each section's part
after a paragraph that starts with :data:`mlemlib.report.tables.MORE`
folded behind one click, so that the key columns fit a 1400-pixel screen),
and :func:`runs_html` writes ``runs.csv`` as one table, its key columns
first.
"""

from __future__ import annotations

import base64
import mimetypes
import os
from html import escape
from pathlib import Path
from typing import Any

from mlemlib.report.rows import config_label, run_columns
from mlemlib.report.tables import MORE

_STYLE = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:13px;margin:1em 1.5em;color:#222}"
    "h1{font-size:1.5em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}h3{font-size:1.05em}"
    "p{max-width:75em;line-height:1.4}table{border-collapse:collapse;margin:.5em 0 1.2em;display:block;"
    "overflow-x:auto;max-width:100%}th,td{border:1px solid #ccc;padding:2px 5px;text-align:left;white-space:nowrap}"
    # a long configuration label wraps inside its column rather than push the key columns off screen
    "td:first-child{white-space:normal;min-width:10em;max-width:22em}"
    "th{background:#f2f2f2;position:sticky;top:0}td.n{text-align:right}"
    "code{background:#f4f4f4;padding:0 2px}img{max-width:100%;height:auto;display:block;margin:.5em 0 1.5em}"
    "details{margin:.2em 0 1.2em}summary{cursor:pointer;color:#1a5fb4;margin:.4em 0}"
    "details[open]>summary{margin-bottom:.6em}"
)


def html_page(title: str, body: str) -> str:
    """A complete HTML page of ``body`` with the summary's style."""
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>\n{body}</body></html>\n")


def _embed_images(md: Any, base: Path) -> None:
    """Make ``md`` replace each local image's ``src`` by a data URI of the file (relative to ``base``)."""
    from markdown.treeprocessors import Treeprocessor

    class Embed(Treeprocessor):
        def run(self, root):
            for img in root.iter("img"):
                src = img.get("src", "")
                if not src or "://" in src or src.startswith("data:"):
                    continue
                path = base / src
                mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                try:
                    data = path.read_bytes()
                except OSError:
                    continue  # left as a link
                img.set("src", f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}")
            return None

    md.treeprocessors.register(Embed(md), "embed_images", 0)


def _fold_details(md: Any) -> None:
    """Make ``md`` fold each section's part from a :data:`MORE` paragraph to the next ``h1``/``h2`` heading
    into a ``<details>`` element whose ``<summary>`` is that paragraph."""
    import xml.etree.ElementTree as ET

    from markdown.treeprocessors import Treeprocessor

    class Fold(Treeprocessor):
        def run(self, root):
            children = list(root)
            folded = None
            for child in children:
                text = "".join(child.itertext()).strip()
                if child.tag == "p" and text.startswith(MORE):
                    folded = ET.Element("details")
                    summary = ET.SubElement(folded, "summary")
                    summary.text = text
                    folded.tail = "\n"
                    root.insert(list(root).index(child), folded)
                    root.remove(child)
                elif child.tag in ("h1", "h2"):
                    folded = None
                elif folded is not None:
                    root.remove(child)
                    folded.append(child)
            return None

    md.treeprocessors.register(Fold(md), "fold_details", 1)


def markdown_page(text: str, title: str, *, base: str | os.PathLike | None = None) -> str:
    """An HTML page of Markdown ``text`` (headings, paragraphs, lists, pipe tables, images).

    Parameters
    ----------
    text
        The Markdown (Python-Markdown with its ``tables`` extension); raw
        HTML in it is shown as text, not interpreted. From a paragraph
        starting with :data:`MORE` to the next ``#``/``##`` heading the
        page folds the text behind a click (``<details>``).
    title
        The page's title.
    base
        Where the images' relative paths start (the Markdown file's
        directory): the files found there are embedded as data URIs. None:
        images stay links.
    """
    import markdown

    md = markdown.Markdown(extensions=["tables"], output_format="html")
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    _fold_details(md)
    if base is not None:
        _embed_images(md, Path(base))
    return html_page(title, md.convert(text) + "\n")


def runs_html(rows: list[dict[str, Any]], csv_name: str, title: str) -> str:
    """An HTML page of ``runs.csv``: one row per run and repetition, numbers to 6 significant digits.

    The key columns come first (the configuration's label, the repetition, its
    time per iteration, its error against the reference, whether it is
    deterministic), then every column of ``runs.csv`` in its order.
    """
    key = ["repetition", "iteration_mean_s", "rel_l2_reference", "deterministic"]
    cols = ["configuration", *key, *(c for c in run_columns(rows) if c not in key)]
    rows = [{"configuration": config_label(r), **r} for r in rows]

    def cell(v: Any) -> str:
        if v is None or v == "":
            return "<td></td>"
        if isinstance(v, float):
            return f"<td class=\"n\">{v:.6g}</td>"
        if isinstance(v, (int, bool)):
            return f"<td class=\"n\">{v}</td>"
        return f"<td>{escape(str(v))}</td>"

    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(cell(r.get(c)) for c in cols) + "</tr>" for r in rows)
    intro = (f"<h1>{escape(title)}</h1><p>One row per run and repetition ({len(rows)} rows): the configuration, "
             "times per iteration and per step in seconds, bandwidths in GB/s, the image sum and its errors. "
             f"Numbers are shown to 6 significant digits; <code>{escape(csv_name)}</code> beside this file has "
             "them in full. docs/reconstruction.md describes every column.</p>")
    return html_page(title, f"{intro}<table><tr>{head}</tr>{body}</table>\n")
