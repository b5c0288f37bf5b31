"""Diagrams drawn from the code's own tables, as inline SVG (no JavaScript, no CDN, no Graphviz).

    checkpoint_statuses()   daemon.registry.status.TRANSITIONS (every allowed status change)
    worker_states()         daemon.rollout.states.ALLOWED (every allowed worker transition)
    process()               trainer -> source -> registry -> checks -> rollout -> workers, loader

A state graph is laid out in rows: a node's row is its longest distance from the start state over
the edges that go forward in the enum's order, nodes within a row in that order. Edges to a later row are solid; edges back to an
earlier or the same row are dashed and bend around the side; a self-loop is a small arc. Every SVG
carries `data-diagram` and one `<g class="node" data-node=NAME>` per state, which the browser check
(tests/docs/test_docs_site.py) looks for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from html import escape

NODE_W, NODE_H = 116, 34
GAP_X, GAP_Y = 34, 64
MARGIN = 40
FILL, STROKE, BACK = "#dbe9fb", "#1f5fa8", "#9a6a00"
STYLE = ("font-family: sans-serif; font-size: 13px;")


def _layers(start: str, order: list[str], edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Rows by the longest path from `start` over the edges that go forward in the enum's order
    (the order the code lists the states in is the pipeline's order)."""
    row = {node: 0 for node in order}
    for node in order:  # the enum order is a topological order of the forward edges
        for nxt in edges.get(node, ()):
            if order.index(nxt) > order.index(node):
                row[nxt] = max(row[nxt], row[node] + 1)
    rows: list[list[str]] = [[] for _ in range(max(row.values()) + 1)]
    for node in order:
        rows[row[node]].append(node)
    return rows


def state_graph(name: str, start: str, order: list[str], edges: Mapping[str, Iterable[str]],
                title: str) -> str:  # fmt: skip
    """An SVG of a transition table: `edges[a]` are the states `a` may move to."""
    rows = _layers(start, order, edges)
    widest = max(len(r) for r in rows)
    width = MARGIN * 2 + widest * NODE_W + (widest - 1) * GAP_X + 180  # room for the side bends and legend
    height = MARGIN * 2 + len(rows) * NODE_H + (len(rows) - 1) * GAP_Y
    pos: dict[str, tuple[float, float]] = {}
    row_of: dict[str, int] = {}
    for r, row in enumerate(rows):
        row_w = len(row) * NODE_W + (len(row) - 1) * GAP_X
        x0 = 60 + (width - 180 - row_w) / 2
        for i, node in enumerate(row):
            pos[node] = (x0 + i * (NODE_W + GAP_X) + NODE_W / 2, MARGIN + r * (NODE_H + GAP_Y) + NODE_H / 2)
            row_of[node] = r
    parts = [_svg_open(name, width, height, title)]
    for a in order:
        for b in sorted(edges.get(a, ()), key=order.index):
            parts.append(_edge(pos[a], pos[b], a == b, row_of[b] <= row_of[a] and a != b, f"{a}->{b}"))
    for node in order:
        x, y = pos[node]
        parts.append(f'<g class="node" data-node="{escape(node)}"><rect x="{x - NODE_W / 2:.1f}" '
                     f'y="{y - NODE_H / 2:.1f}" width="{NODE_W}" height="{NODE_H}" rx="8" fill="{FILL}" '
                     f'stroke="{STROKE}" stroke-width="1.5"/><text x="{x:.1f}" y="{y + 4.5:.1f}" '
                     f'text-anchor="middle" fill="#10233d">{escape(node)}</text></g>')  # fmt: skip
    parts.append(_legend(width - 150, MARGIN))
    parts.append("</svg>")
    return "".join(parts)


def _svg_open(name: str, width: float, height: float, title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" data-diagram="{escape(name)}" role="img" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" width="100%" style="max-width:{width:.0f}px; {STYLE}">'
            f"<title>{escape(title)}</title><defs>"
            f'<marker id="{name}-fwd" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{STROKE}"/></marker>'
            f'<marker id="{name}-back" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{BACK}"/></marker></defs>'
            )  # fmt: skip


def _edge(a: tuple[float, float], b: tuple[float, float], loop: bool, back: bool, label: str) -> str:
    (x1, y1), (x2, y2) = a, b
    marker = "back" if (back or loop) else "fwd"
    color = BACK if (back or loop) else STROKE
    dash = ' stroke-dasharray="5 4"' if (back or loop) else ""
    if loop:
        sx, sy = x1 + NODE_W / 2, y1 - 6
        d = f"M{sx:.1f},{sy:.1f} C{sx + 34:.1f},{sy - 26:.1f} {sx + 34:.1f},{sy + 38:.1f} {sx:.1f},{sy + 12:.1f}"
    elif not back:
        sy, ey = y1 + NODE_H / 2, y2 - NODE_H / 2
        mid = (sy + ey) / 2
        d = f"M{x1:.1f},{sy:.1f} C{x1:.1f},{mid:.1f} {x2:.1f},{mid:.1f} {x2:.1f},{ey - 2:.1f}"
    else:  # back to an earlier row (or along one): out of the side, bending outwards
        side = 1 if x2 >= x1 else -1
        if abs(x2 - x1) < 1:
            side = 1
        sx, ex = x1 + side * NODE_W / 2, x2 + (side if abs(y2 - y1) > 1 else -side) * NODE_W / 2
        bend = 40 + abs(y2 - y1) * 0.35
        c1x = sx + side * bend
        c2x = ex + (side if abs(y2 - y1) > 1 else -side) * bend
        if abs(y2 - y1) < 1:  # same row: an arc over the top
            sx, ex = x1, x2
            top = y1 - NODE_H / 2 - 30 - abs(x2 - x1) * 0.08
            d = f"M{sx:.1f},{y1 - NODE_H / 2:.1f} C{sx:.1f},{top:.1f} {ex:.1f},{top:.1f} {ex:.1f},{y2 - NODE_H / 2 - 2:.1f}"
            return _path(d, color, dash, marker, label)
        d = f"M{sx:.1f},{y1:.1f} C{c1x:.1f},{y1:.1f} {c2x:.1f},{y2:.1f} {ex + side * 2:.1f},{y2:.1f}"
    return _path(d, color, dash, marker, label)


def _path(d: str, color: str, dash: str, marker: str, label: str) -> str:
    return (f'<path class="edge" data-edge="{escape(label)}" d="{d}" fill="none" stroke="{color}" stroke-width="1.4"'
            f'{dash} marker-end="url(#{{owner}}-{marker})"><title>{escape(label)}</title></path>')  # fmt: skip


def _legend(x: float, y: float) -> str:
    return (f'<g class="legend" font-size="11"><line x1="{x}" y1="{y}" x2="{x + 28}" y2="{y}" stroke="{STROKE}" '
            f'stroke-width="1.4"/><text x="{x + 34}" y="{y + 4}">onwards</text>'
            f'<line x1="{x}" y1="{y + 18}" x2="{x + 28}" y2="{y + 18}" stroke="{BACK}" stroke-width="1.4" '
            f'stroke-dasharray="5 4"/><text x="{x + 34}" y="{y + 22}">back / again</text></g>')  # fmt: skip


def _named(svg: str, name: str) -> str:
    return svg.replace("{owner}", name)


def checkpoint_statuses() -> str:
    from daemon.registry.models import CheckpointStatus
    from daemon.registry.status import TRANSITIONS

    order = [s.value for s in CheckpointStatus]
    edges = {a.value: [b.value for b in bs] for a, bs in TRANSITIONS.items()}
    name = "checkpoint-statuses"
    return _named(state_graph(name, "discovered", order, edges,
                              "Checkpoint statuses and their allowed transitions (daemon.registry.status.TRANSITIONS)"),
                  name)  # fmt: skip


def worker_states() -> str:
    from daemon.rollout.states import ALLOWED, WorkerState

    order = [s.value for s in WorkerState]
    edges = {a.value: [b.value for b in bs] for a, bs in ALLOWED.items()}
    name = "worker-states"
    return _named(state_graph(name, "RUNNING", order, edges,
                              "Worker states and their allowed transitions (daemon.rollout.states.ALLOWED)"), name)


def transition_table(kind: str) -> str:
    """The same table as text: `from` -> every `to`, for readers and screen readers."""
    if kind == "checkpoint":
        from daemon.registry.status import TRANSITIONS as table
    else:
        from daemon.rollout.states import ALLOWED as table  # type: ignore[assignment]
    lines = ["| from | may move to |", "|---|---|"]
    for a, bs in table.items():
        lines.append(f"| `{a.value}` | {', '.join(f'`{b.value}`' for b in sorted(bs, key=list(table).index))} |")
    return "\n".join(lines)


PROCESS = [  # (id, label, sub-label, column, row)
    ("trainer", "trainer", "publish / push / broadcast", 0, 1),
    ("source", "sources", "local · s3 · push", 1, 1),
    ("registry", "registry (SQL)", "statuses · events", 2, 0),
    ("checks", "checks", "manifest … forward", 2, 2),
    ("rollout", "rollout", "plan · stage · move", 3, 1),
    ("loader", "loader", "ipc staging", 4, 0),
    ("workers", "workers", "builtin · vLLM · SGLang", 4, 2),
]
PROCESS_EDGES = [("trainer", "source", "checkpoint"), ("source", "registry", "discovered"),
                 ("registry", "checks", "verify"), ("checks", "registry", "verdict"),
                 ("checks", "rollout", "verified"), ("registry", "rollout", "aliases"),
                 ("rollout", "loader", "stage once"), ("loader", "workers", "map / copy"),
                 ("rollout", "workers", "drain · pause · update"), ("trainer", "workers", "broadcast")]  # fmt: skip


HAPPY_PATH = {"RUNNING": ["DRAINING", "PAUSED"], "DRAINING": ["UPDATED"], "PAUSED": ["UPDATED"], "UPDATED": ["RUNNING"]}


def worker_happy_path() -> str:
    """An update that goes well: the four states every worker walks, drained or paused."""
    name = "worker-happy-path"
    return _named(state_graph(name, "RUNNING", list(HAPPY_PATH), HAPPY_PATH,
                              "A worker's update that goes well: drained or paused, updated, running again"), name)


def process() -> str:
    """One checkpoint's way through the daemon, as boxes and arrows."""
    w, h, gx, gy = 150, 50, 60, 46
    width = MARGIN * 2 + 5 * w + 4 * gx
    height = MARGIN * 2 + 3 * h + 2 * gy + 30
    name = "process"
    pos = {i: (MARGIN + c * (w + gx) + w / 2, MARGIN + r * (h + gy) + h / 2) for i, _, _, c, r in PROCESS}
    parts = [_svg_open(name, width, height, "A checkpoint's way: trainer, source, registry, checks, rollout, workers")]
    for a, b, label in PROCESS_EDGES:
        (x1, y1), (x2, y2) = pos[a], pos[b]
        if a == "trainer" and b == "workers":  # under everything
            yb = height - MARGIN + 8
            d = (f"M{x1:.1f},{y1 + h / 2:.1f} C{x1:.1f},{yb:.1f} {x1 + 60:.1f},{yb:.1f} {(x1 + x2) / 2:.1f},{yb:.1f} "
                 f"S{x2:.1f},{yb:.1f} {x2:.1f},{y2 + h / 2 + 2:.1f}")  # fmt: skip
            lx, ly = (x1 + x2) / 2, yb - 5
        else:
            ang = math.atan2(y2 - y1, x2 - x1)
            off = 6 if (b, a, ) in {(e[0], e[1]) for e in PROCESS_EDGES} else 0
            ox, oy = -math.sin(ang) * off, math.cos(ang) * off
            sx, sy = _box_edge(x1, y1, x2, y2, w, h)
            ex, ey = _box_edge(x2, y2, x1, y1, w, h)
            d = f"M{sx + ox:.1f},{sy + oy:.1f} L{ex + ox:.1f},{ey + oy:.1f}"
            lx, ly = (sx + ex) / 2 + ox * 2.2, (sy + ey) / 2 + oy * 2.2 - 4
        anchor = "middle"
        if a != "trainer" and abs(x2 - x1) < abs(y2 - y1):  # steep: beside the line (a pair: each on its side)
            side = 1 if ox >= 0 else -1
            anchor, lx, ly = ("start" if side > 0 else "end"), (sx + ex) / 2 + ox + side * 6, (sy + ey) / 2 + 4
        parts.append(_path(d, STROKE, "", "fwd", f"{a}->{b}").replace("{owner}", name))
        parts.append(f'<text x="{lx:.1f}" y="{ly:.1f}" text-anchor="{anchor}" font-size="11" fill="#333" '
                     f'stroke="#fff" stroke-width="3" paint-order="stroke">{escape(label)}</text>')  # fmt: skip
    for i, label, sub, _, _ in PROCESS:
        x, y = pos[i]
        parts.append(f'<g class="node" data-node="{escape(i)}"><rect x="{x - w / 2:.1f}" y="{y - h / 2:.1f}" '
                     f'width="{w}" height="{h}" rx="8" fill="{FILL}" stroke="{STROKE}" stroke-width="1.5"/>'
                     f'<text x="{x:.1f}" y="{y - 3:.1f}" text-anchor="middle" font-weight="bold" fill="#10233d">'
                     f'{escape(label)}</text><text x="{x:.1f}" y="{y + 14:.1f}" text-anchor="middle" font-size="11" '
                     f'fill="#334">{escape(sub)}</text></g>')  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def _box_edge(x: float, y: float, tx: float, ty: float, w: float, h: float) -> tuple[float, float]:
    """Where the line from a box's centre towards (tx, ty) leaves the box."""
    dx, dy = tx - x, ty - y
    if dx == 0 and dy == 0:
        return x, y
    scale = min((w / 2) / abs(dx) if dx else math.inf, (h / 2) / abs(dy) if dy else math.inf)
    return x + dx * scale, y + dy * scale
