"""A self-contained HTML page for an `hqtflow inspect` report: key figures, matplotlib charts embedded as base64
PNG data URIs (Agg backend, no files beside the page), and tables. Key figures carry ids (`nodes-measured`,
`nodes-quantized`, `outliers`, ...); a small script sets `data-images-ok` on <body> once every <img> decoded.
"""

from __future__ import annotations

import base64
import html
import io

MAX_ROWS = 200


# How every report starts: `hqtflow inspect --html` replaces only a file that begins so.
HTML_HEAD = '<!DOCTYPE html><html><head><meta charset="utf-8"><title>hqtflow inspect: '


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _bar_chart(layers: list[dict], series: list[tuple[str, str]], title: str, ylabel: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["name"] for r in layers]
    present = [(k, lbl) for k, lbl in series if any(_num(r.get(k)) for r in layers)]
    if not names or not present:
        return None
    fig, ax = plt.subplots(figsize=(12, 4))
    x = np.arange(len(names))
    w = 0.8 / len(present)
    for i, (k, lbl) in enumerate(present):
        vals = [(_num(r.get(k)) or np.nan) for r in layers]
        vals = [v if v and v > 0 else np.nan for v in vals]
        ax.bar(x + i * w - 0.4 + w / 2, vals, width=w, label=lbl)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=90, fontsize=max(3, min(8, int(400 / max(len(names), 1)))))
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def _table(rows: list[dict], cols: list[str], tid: str) -> str:
    if not rows:
        return f'<p id="{tid}" class="empty">(none)</p>'

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows[:MAX_ROWS])
    more = f"<p>{len(rows) - MAX_ROWS} more rows in the JSON report.</p>" if len(rows) > MAX_ROWS else ""
    return f'<table id="{tid}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}'


def render_html(rep: dict) -> str:
    """The page for an inspection report (`rep` carries its own `rules`, so this module needs nothing of inspection)."""
    RULES = rep["rules"]
    kind = rep["kind"]
    s = rep["summary"]
    e = html.escape
    figs = "".join(
        f'<div class="fig"><div class="label">{e(k.replace("_", " "))}</div>'
        f'<div class="value" id="{e(k.replace("_", "-"))}">{e(f"{v:.4g}" if isinstance(v, float) else str(v))}</div></div>'
        for k, v in s.items())
    parts = [f"<h1>hqtflow inspect: {e(kind)}</h1>", f'<p>Artifact <code id="artifact-path">{e(rep["artifact"])}</code>, '
             f'kind <span id="artifact-kind">{e(kind)}</span></p>', f'<div class="figs">{figs}</div>']
    layers = rep["layers"]
    if kind == "measurement":
        img = _bar_chart(layers, [("input_maxabs", "input"), ("output_maxabs", "output"), ("weight_maxabs", "weight")],
                         "Per-layer maxabs", "maxabs (log)")
        img2 = _bar_chart(layers, [("input_scale_pow2", "input"), ("output_scale_pow2", "output"), ("weight_scale_pow2", "weight")],
                          "Per-tensor scales under maxabs_pow2", "scale (log)")
    else:
        img = _bar_chart(layers, [("measured_input_maxabs", "measured input maxabs")], "Per-layer measured input maxabs",
                         "maxabs (log)")
        img2 = _bar_chart(layers, [("input_scale", "input scale"), ("weight_scale", "weight scale")], "Per-layer scales",
                          "scale (log)")
    for i, (src, cap) in enumerate(((img, "maxabs"), (img2, "scales"))):
        if src:
            parts.append(f'<figure><img id="chart-{cap}" alt="{cap} chart" src="{src}"></figure>')
        else:
            parts.append(f'<p id="chart-{cap}-missing">No {cap} data to chart.</p>')
    cov = rep["coverage"]
    missing = cov.get("not_measured", cov.get("not_quantized", {}))
    parts += [f"<h2>Not {'measured' if kind == 'measurement' else 'quantized'}</h2>",
              _table([{"name": n, "reason": r} for n, r in missing.items()], ["name", "reason"], "not-covered")]
    rg = rep["ranges"]
    for stat in ("input", "output"):
        if rg.get(f"top_{stat}"):
            parts += [f"<h2>Largest {stat} maxabs</h2>", _table(rg[f"top_{stat}"], ["name", "maxabs"], f"top-{stat}")]
    parts += [f"<h2>Outliers</h2><p>{e(RULES['outlier'])}</p>",
              _table(rg["outliers"], ["name", "stat", "maxabs", "kind_median", "ratio"], "outlier-table")]
    sc = rep["scales"]
    if kind == "measurement":
        parts += [f"<h2>Scale flags</h2><p>{e(RULES['measurement_scale'])}</p>",
                  _table(sc["flags"], ["name", "stat", "maxabs", "scale", "flag"], "scale-flags")]
    else:
        parts += [f"<h2>Activation headroom</h2><p>{e(RULES['activation_headroom'])}</p>",
                  _table(sc["headroom_flags"], ["name", "input_scale", "measured_maxabs", "headroom", "flag"], "headroom-flags")
                  if sc["measured_maxabs_available"] else '<p id="headroom-flags">Skipped: no measured maxabs.</p>']
        if kind == "checkpoint":
            parts += [f"<h2>Weight underflow</h2><p>{e(RULES['weight_underflow'])}</p>",
                      _table(sc["weight_flags"], ["name", "weight_scale", "occupancy", "zero_fraction", "flag"], "weight-flags")]
        we = rep["weight_error"]
        parts += [f"<h2>Weight quantization error</h2><p>{e(RULES['weight_error'])}</p>",
                  _table(we["layers"], ["name", "rel_rms", "sqnr_db"], "weight-error") if we["available"]
                  else '<p id="weight-error">Not computed: see the notes.</p>']
    if "compare" in rep:
        c = rep["compare"]
        parts += [f"<h2>Comparison with <code>{e(c['other'])}</code></h2>",
                  f'<p><span id="compare-common">{c["common"]}</span> common nodes, '
                  f'<span id="compare-only-this">{len(c["only_in_this"])}</span> only here, '
                  f'<span id="compare-only-other">{len(c["only_in_other"])}</span> only in the other.</p>',
                  _table(c["largest_changes"], ["name", "stat", "this", "other", "ratio"], "compare-changes")]
    cols = sorted({k for r in layers for k in r if k != "name"})
    parts += ["<h2>All layers</h2>", _table(layers, ["name", *cols], "layers")]
    if rep.get("notes"):
        parts.append("<h2>Notes</h2><ul id=\"notes\">" + "".join(f"<li>{e(n)}</li>" for n in rep["notes"]) + "</ul>")
    css = ("body{font-family:sans-serif;margin:20px;color:#222}table{border-collapse:collapse;font-size:12px;margin:8px 0}"
           "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}th{background:#eef}"
           ".figs{display:flex;flex-wrap:wrap;gap:8px}.fig{border:1px solid #99c;border-radius:4px;padding:6px 10px;"
           "background:#f4f6ff}.label{font-size:11px;color:#555}.value{font-size:20px;font-weight:bold}"
           "img{max-width:100%}code{background:#f3f3f3}")
    script = ("<script>function chk(){var im=Array.from(document.images);var ok=im.every(function(i){return i.complete&&"
              "i.naturalWidth>0});document.body.setAttribute('data-images',String(im.length));"
              "document.body.setAttribute('data-images-ok',ok?'true':'false');}"
              "window.addEventListener('load',chk);</script>")
    return (f"{HTML_HEAD}{e(kind)}</title>"
            f"<style>{css}</style></head><body>{''.join(parts)}{script}</body></html>\n")
