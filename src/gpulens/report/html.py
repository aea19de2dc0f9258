"""One self-contained HTML file from report sections: plotly's JavaScript is inlined from the
installed package (never fetched), so the file works offline and can be mailed or archived."""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import datetime, timezone

from gpulens import __version__
from gpulens.report.document import Section

# Every figure's camera button saves a PNG; the SVG button is added to the mode bar.
FIGURE_CONFIG = {
    "displaylogo": False,
    "responsive": True,
    "toImageButtonOptions": {"format": "png", "scale": 2},
    "modeBarButtonsToAdd": ["toImage"],
}
SVG_BUTTON_JS = """
document.querySelectorAll('.js-plotly-plot').forEach(function (gd) {
  var b = document.createElement('button');
  b.textContent = 'SVG'; b.className = 'svg';
  b.onclick = function () { Plotly.downloadImage(gd, {format: 'svg', filename: gd.id}); };
  gd.parentNode.insertBefore(b, gd);
});
"""
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5rem; }
h2 { font-size: 1.2rem; margin-top: 2.5rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5rem 0 1rem; font-size: .9rem; }
td, th { border: 1px solid #ddd; padding: .25rem .6rem; text-align: left; }
td.marked { background: #fde2d8; font-weight: 600; }
.note { color: #666; font-size: .9rem; } .meta { color: #666; font-size: .85rem; }
button.svg { float: right; font-size: .75rem; margin: .2rem; }
"""


def _facts_table(facts: Sequence[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    return f"<table class='facts'>{rows}</table>"


def _grid(section: Section) -> str:
    assert section.table is not None
    header, *rows = section.table
    head = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = []
    for i, row in enumerate(rows, start=1):
        cells = "".join(
            f"<td class='marked'>{html.escape(c)}</td>" if (i, j) in section.marked
            else f"<td>{html.escape(c)}</td>"
            for j, c in enumerate(row)
        )  # fmt: skip
        body.append(f"<tr>{cells}</tr>")
    return f"<table class='comparison'><tr>{head}</tr>{''.join(body)}</table>"


def render_html(
    sections: Sequence[Section],
    title: str,
    plotly_js: str | None = None,
    plotly_src: str | None = None,
    head_extra: str = "",
    body_top: str = "",
) -> str:
    """The report page. ``plotly_js``: the library's code to inline (default: the installed
    package's own copy); ``plotly_src``: a URL to load it from instead (the dashboard serves it
    once). ``head_extra``/``body_top``: trusted HTML the dashboard adds (refresh, navigation)."""
    if plotly_src is not None:
        script = f"<script type='text/javascript' src='{html.escape(plotly_src)}'></script>"
    else:
        if plotly_js is None:
            from plotly.offline import get_plotlyjs

            plotly_js = get_plotlyjs()
        script = f"<script type='text/javascript'>{plotly_js}</script>"
    made = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<link rel='icon' href='data:,'>",
        f"<title>{html.escape(title)}</title><style>{STYLE}</style>{head_extra}",
        f"{script}</head><body>{body_top}",
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='meta'>made by gpulens {html.escape(__version__)} on {made}</p>",
    ]
    n = 0
    for section in sections:
        parts.append(f"<section><h2>{html.escape(section.title)}</h2>")
        if section.facts:
            parts.append(_facts_table(section.facts))
        if section.table:
            parts.append(_grid(section))
            parts.append(
                "<p class='note'>Marked: differs from the first run by more than both runs' "
                "95% intervals (5% where no interval is known).</p>"
            )
        for fig in section.figures:
            n += 1
            parts.append(
                fig.to_html(
                    full_html=False, include_plotlyjs=False, div_id=f"figure-{n}",
                    config=FIGURE_CONFIG,
                )
            )  # fmt: skip
        parts += [f"<p class='note'>{html.escape(note)}</p>" for note in section.notes]
        parts.append("</section>")
    parts.append(f"<script>{SVG_BUTTON_JS}</script></body></html>")
    return "\n".join(parts)
