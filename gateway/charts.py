"""Usage charts as inline SVG, drawn on the server: no JavaScript library, no CDN. Each function
takes the rows of one aggregate query and returns markup safe to put in a template."""

from __future__ import annotations

from django.utils.html import escape
from django.utils.safestring import mark_safe

WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 640, 200, 56, 28, 12
COLORS = ("#2f6fb0", "#9cc3e6", "#d08a2c")


def _nice(value: float) -> float:
    """A round number at or above ``value`` for the axis top."""
    if value <= 0:
        return 1
    magnitude = 10 ** (len(str(int(value))) - 1)
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def _number(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    return f"{value:g}"


def _legend(names, y: float) -> str:
    parts = []
    for index, name in enumerate(names):
        x = LEFT + index * 150
        parts.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{COLORS[index % len(COLORS)]}"/>'
                     f'<text x="{x + 14}" y="{y}" font-size="11">{escape(name)}</text>')
    return "".join(parts)


def stacked_bars(title: str, labels: list[str], series: dict[str, list[float]]) -> str:
    """Vertical bars, one per label, each stacking the series' values (e.g. prompt + completion)."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(labels))]
    top = _nice(max(totals, default=0))
    plot_w, plot_h = WIDTH - LEFT - 8, HEIGHT - BOTTOM - TOP
    slot = plot_w / max(1, len(labels))
    bar = max(2.0, slot * 0.7)
    out = [f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {WIDTH} {HEIGHT + 16}" '
           f'width="100%" xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>']
    for fraction in (0, 0.5, 1):
        y = TOP + plot_h * (1 - fraction)
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - 8}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{_number(top * fraction)}</text>')
    for i, label in enumerate(labels):
        x = LEFT + slot * i + (slot - bar) / 2
        base = TOP + plot_h
        for index, (name, values) in enumerate(series.items()):
            h = plot_h * values[i] / top
            if h > 0:
                base -= h
                out.append(f'<rect x="{x:.1f}" y="{base:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                           f'fill="{COLORS[index % len(COLORS)]}"><title>{escape(label)} {escape(name)}: '
                           f'{_number(values[i])}</title></rect>')
        if len(labels) <= 16 or i % max(1, len(labels) // 8) == 0:
            out.append(f'<text x="{x + bar / 2:.1f}" y="{HEIGHT - BOTTOM + 14}" font-size="10" '
                       f'text-anchor="middle">{escape(label)}</text>')
    if len(series) > 1:
        out.append(_legend(series, HEIGHT + 10))
    out.append("</svg>")
    return mark_safe("".join(out))


def grouped_hbars(title: str, labels: list[str], series: dict[str, list[float]], unit: str = "ms") -> str:
    """Horizontal bars, a group per label (e.g. a model) with one bar per series (p50, p95, p99)."""
    top = _nice(max((v for values in series.values() for v in values), default=0))
    row = 14 * len(series) + 10
    height = TOP + row * max(1, len(labels)) + 30
    left = 150
    plot_w = WIDTH - left - 50
    out = [f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {WIDTH} {height}" '
           f'width="100%" xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>']
    for i, label in enumerate(labels):
        y0 = TOP + row * i
        out.append(f'<text x="{left - 6}" y="{y0 + row / 2:.1f}" font-size="11" text-anchor="end">'
                   f'{escape(label[:24])}</text>')
        for index, (name, values) in enumerate(series.items()):
            w = plot_w * values[i] / top
            y = y0 + index * 14
            out.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="12" fill="{COLORS[index % len(COLORS)]}">'
                       f'<title>{escape(label)} {escape(name)}: {values[i]:.1f} {unit}</title></rect>'
                       f'<text x="{left + w + 4:.1f}" y="{y + 10}" font-size="10">{values[i]:.0f}</text>')
    out.append(_legend(series, height - 6))
    out.append("</svg>")
    return mark_safe("".join(out))
