"""The docs site: it builds with `mkdocs build --strict`, its generated parts are there, and a real
headless browser (Debian's chromium) draws the diagrams of the concept pages from the built files,
offline.

The drawing is checked twice: the DOM chromium builds holds each diagram's SVG with one node per
state of the code's own enum, and a screenshot of the page has the diagrams' node fill colour over
an area at least as large as half of those nodes. Skips, saying why, only when chromium is absent.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from conftest import REPO

from daemon.registry.models import CheckpointStatus
from daemon.rollout.states import WorkerState
from tools.docsgen import diagrams

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""})  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_the_generated_references_are_in_the_built_site(site: Path) -> None:
    config = (site / "reference" / "config.html").read_text()
    assert "rejoin_s" in config and "[[sources]] type = \"s3\"" in config
    cli = (site / "reference" / "cli.html").read_text()
    assert "usage: hotswap config check" in cli and "usage: hotswap daemon" in cli and "--listen" in cli
    http = (site / "reference" / "http.html").read_text()
    assert "/v1/rollout/pin" in http and "/v1/push/{version}/commit" in http and "/admin/update" in http
    client = (site / "reference" / "client.html").read_text()
    assert "BroadcastPush" in client and "publish_s3" in client and "run_checks" in client


def test_the_pages_load_nothing_from_the_network(site: Path) -> None:
    for page in site.rglob("*.html"):
        text = page.read_text()
        remote = re.findall(r'<(?:script|link|img|iframe)[^>]+(?:src|href)="(https?:)?//[^"]+"', text)
        assert remote == [], f"{page.relative_to(site)} loads {remote}"


def test_placeholders_are_text_not_html_tags(site: Path) -> None:
    # "<state_dir>" outside a code span would be swallowed by the browser as an unknown tag
    for page in site.rglob("*.html"):
        tags = re.findall(r"<(state_dir|prefix|path|version|name|listen|bucket|cache_dir|hex)>", page.read_text())
        assert tags == [], f"{page.relative_to(site)} has <{tags[0]}> as markup"


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG, filters undone."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0
    bpp = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, bpp, rows


def _count_colour(path: Path, rgb: tuple[int, int, int]) -> int:
    _, bpp, rows = _png_pixels(path)
    want = bytes(rgb)
    return sum(1 for row in rows for i in range(0, len(row), bpp) if row[i:i + 3] == want)


def _chromium(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={tmp / 'profile'}", *args], capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium); "
                    "the browser check of the docs' diagrams needs it")  # fmt: skip
@pytest.mark.parametrize(("page", "diagram", "states"), [
    ("concepts/checkpoints.html", "checkpoint-statuses", [s.value for s in CheckpointStatus]),
    ("concepts/workers.html", "worker-states", [s.value for s in WorkerState]),
    ("concepts/workers.html", "worker-happy-path", ["RUNNING", "DRAINING", "PAUSED", "UPDATED"]),
])  # fmt: skip
def test_chromium_draws_the_state_diagrams(site: Path, tmp_path: Path, page: str, diagram: str,
                                           states: list[str]) -> None:  # fmt: skip
    url = (site / page).as_uri()
    dom = _chromium(["--dump-dom", url], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    svg = re.search(rf'<svg[^>]*data-diagram="{diagram}".*?</svg>', dom.stdout, re.S)
    assert svg is not None, f"no {diagram} SVG in the DOM chromium built"
    assert sorted(re.findall(r'data-node="([^"]+)"', svg.group(0))) == sorted(states)
    shot = tmp_path / "page.png"
    run = _chromium(["--window-size=1280,2400", f"--screenshot={shot}", url], tmp_path)
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    fill = tuple(int(diagrams.FILL[i:i + 2], 16) for i in (1, 3, 5))
    drawn = _count_colour(shot, fill)  # type: ignore[arg-type]
    assert drawn >= len(states) * diagrams.NODE_W * diagrams.NODE_H * 0.25, f"{drawn} node pixels drawn"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium)")
def test_a_page_without_diagrams_has_none_of_their_colour(site: Path, tmp_path: Path) -> None:
    # the colour count above means something: a page without a diagram has (almost) none of it
    shot = tmp_path / "plain.png"
    run = _chromium(["--window-size=1280,2400", f"--screenshot={shot}", (site / "troubleshooting.html").as_uri()],
                    tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    fill = tuple(int(diagrams.FILL[i:i + 2], 16) for i in (1, 3, 5))
    assert _count_colour(shot, fill) < 100  # type: ignore[arg-type]
