"""The README front page and the hand-written docs keep their promises: the two quickstart commands
first and unchanged (and `.ci/run` runs that same test command), `hotswap` put on PATH before it is
first used, one way to install torch, every section the README used to have a home in docs/, and
the parts that restate code (problem kinds, the README's picture) in step with it."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

from daemon.common.problems import NOUNS
from tools.docsgen import diagrams

pytestmark = pytest.mark.quick

README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"
QUICKSTART = [
    "./scripts/run-daemon.sh     # creates .venv (torch 2.13.0 first, then `pip install -e .`), runs `hotswap daemon`",
    "./scripts/test.sh           # creates .venv with the dev extra, runs the whole test suite: ~30 min on 2 cores",
]


def code_blocks(text: str) -> list[list[str]]:
    return [block.strip("\n").splitlines() for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S)]


def test_the_readme_is_a_front_page_that_opens_with_the_two_commands() -> None:
    lines = README.splitlines()
    assert len(lines) <= 150
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[0] == "## Quickstart"
    assert code_blocks(README)[0] == QUICKSTART


def test_the_readme_says_how_long_the_suite_takes_and_names_the_quick_tier() -> None:
    text = " ".join(README.split())
    assert "~30 min on 2 cores" in QUICKSTART[1] and "./scripts/test.sh -m quick -q" in text


def test_ci_runs_the_quickstart_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci[-1].startswith("exec ./scripts/test.sh ") and '"$@"' in ci[-1]
    assert QUICKSTART[1].split()[0] == "./scripts/test.sh"


def _first_use_after_activation(text: str) -> bool:
    activated = False
    for block in code_blocks(text):
        for line in block:
            if "source .venv/bin/activate" in line:
                activated = True
            if re.match(r"^(hotswap|\S+=\$\(hotswap) ", line):
                return activated
    return activated


def test_hotswap_is_put_on_path_before_its_first_use() -> None:
    assert _first_use_after_activation(README)
    assert _first_use_after_activation((DOCS / "getting-started.md").read_text())
    assert not _first_use_after_activation("```bash\nhotswap status\nsource .venv/bin/activate\n```\n")


def test_the_tiny_model_is_said_to_answer_random_bytes() -> None:
    assert "random bytes" in " ".join(README.split())
    assert "random bytes" in " ".join((DOCS / "getting-started.md").read_text().split())


def test_every_torch_install_names_its_index() -> None:
    for path in [REPO / "README.md", *DOCS.rglob("*.md")]:
        text = path.read_text()
        commands = [line for block in code_blocks(text) for line in block]
        commands += [line for line in text.splitlines() if line.startswith("|")]  # tables of commands
        for line in commands:
            if re.search(r"pip install (-\S+ )*torch==", line):
                assert "--index-url" in line, f"{path.relative_to(REPO)}: {line.strip()}"


# The README's sections before it became a front page, and where each lives now (a phrase of it).
MOVED = {
    "Installing": ("how-to/install.md", "The wheel carries its database migrations"),
    "Publishing a checkpoint": ("how-to/publish.md", "Names starting with `.` are ignored"),
    "Checkpoints from S3": ("how-to/publish.md", "IAM permissions for the daemon"),
    "Pushing checkpoints to the daemon": ("how-to/push.md", "An upload's slot is given back"),
    "Querying the history": ("operations/history.md", "Two views answer the everyday questions"),
    "Rolling out": ("concepts/workers.md", "Drain mode never takes a whole group out of rotation"),
    "Control API": ("reference/http.md", "At its first start the daemon writes 32 random bytes"),
    "Pushing weights from the trainer (broadcast)": ("how-to/broadcast.md", "Each push is a rollout"),
    "The reference worker": ("reference/worker.md", "An update checks every tensor name"),
    'Driving vLLM (`kind = "vllm"`)': ("how-to/vllm.md", "Keep the port private."),
    'Driving SGLang (`kind = "sglang"`)': ("how-to/sglang.md", "Its faults, handled"),
    "How fast": ("reference/performance.md", "8B layout = Llama-3-8B shapes"),
    "Configuration": ("reference/config.md", "One process migrates a database at a time"),
    "Install as a systemd service": ("how-to/systemd.md", "What the sandbox means for a deployment"),
    "Signals, restarts and metrics": ("operations/logs.md", "One daemon per state directory."),
    "Health: the problems the daemon reports": ("operations/problems.md", "`GET /livez` is liveness only"),
    "Fleets on PostgreSQL": ("how-to/fleets.md", "The fleet target"),
    "Commands": ("reference/cli.md", "manual control of the running daemon"),
    "Development": ("contributing.md", "HOTSWAP_TEST_HOLD_STATE"),
    "Quickstart (the managed worker)": ("concepts/workers.md", "hands the listening socket to every worker"),
}


def test_every_former_readme_section_has_a_home_in_the_docs() -> None:
    missing = [f"{title}: {page} lacks {phrase!r}" for title, (page, phrase) in MOVED.items()
               if phrase not in " ".join((DOCS / page).read_text().split())]  # fmt: skip
    assert missing == []


def test_every_problem_kind_is_documented() -> None:
    page = (DOCS / "operations" / "problems.md").read_text()
    assert [kind for kind in NOUNS if f"`{kind}`" not in page] == []


def test_the_readme_picture_is_the_generated_process_diagram() -> None:
    # the README cannot run the docs hooks, so it shows a copy; regenerate it with
    # `python -c "from tools.docsgen import diagrams; open('docs/assets/process.svg','w').write(diagrams.process()+'\\n')"`
    assert "docs/assets/process.svg" in README
    assert (DOCS / "assets" / "process.svg").read_text() == diagrams.process() + "\n"


def test_every_page_is_in_the_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    assert [p for p in pages if f": {p}" not in nav] == []


def test_the_process_diagrams_labels_do_not_overlap() -> None:
    """Issue 36: "verify" and "verdict" (registry <-> checks, a steep pair of arrows) were drawn
    over each other. Each edge label's box (11 px text, ~0.56 em a character) is clear of the others."""
    import re

    svg = (DOCS / "assets" / "process.svg").read_text()
    boxes = []
    for m in re.finditer(r'<text x="([\d.]+)" y="([\d.]+)" text-anchor="(\w+)" font-size="11" fill="#333"[^>]*>([^<]*)</text>',
                         svg):  # fmt: skip
        x, y, anchor, label = float(m[1]), float(m[2]), m[3], m[4]
        w = 0.56 * 11 * len(label)
        left = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
        boxes.append((label, left, left + w, y - 11, y + 2))
    assert len(boxes) == len(diagrams.PROCESS_EDGES)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = a[2] <= b[1] or b[2] <= a[1] or a[4] <= b[3] or b[4] <= a[3]
            assert apart, f"labels {a[0]!r} and {b[0]!r} overlap: {a[1:]} / {b[1:]}"


def test_config_files_point_only_at_pages_and_sections_that_exist() -> None:
    """config.example.toml and daemon/config.py name README sections and docs pages (issue 36:
    three README sections they named did not exist): every one must be there."""
    headings = {m.strip() for m in re.findall(r"^#+ (.+)$", README, re.M)}
    refs = 0
    for path in (REPO / "config.example.toml", REPO / "daemon" / "config.py"):
        text = " ".join(path.read_text().split())
        for section in re.findall(r'README "([^"]+)"', text):
            refs += 1
            assert section in headings, f"{path.name}: README has no section {section!r}"
        for page, section in re.findall(r'(docs/[\w/.-]+\.md)(?:, "([^"]+)")?', text):
            refs += 1
            assert (REPO / page).is_file(), f"{path.name}: {page} does not exist"
            if section:
                titles = re.findall(r"^#+ (.+)$", (REPO / page).read_text(), re.M)
                assert any(t.startswith(section) for t in titles), f"{path.name}: {page} has no section {section!r}"
    assert refs >= 4


def test_the_happy_path_of_a_worker_comes_before_every_transition() -> None:
    """Issue 36: the full worker-state diagram draws nearly every pair both ways; the page shows
    the four states of an update that goes well first, the full diagram after."""
    page = (DOCS / "concepts" / "workers.md").read_text()
    assert page.index("<!-- gen:diagram:worker-happy-path -->") < page.index("<!-- gen:diagram:worker-states -->")
    svg = diagrams.worker_happy_path()
    assert sorted(re.findall(r'data-node="([^"]+)"', svg)) == ["DRAINING", "PAUSED", "RUNNING", "UPDATED"]
    assert len(re.findall(r'class="edge"', svg)) == 5


def prose_before_the_second_command(page: str) -> list[str]:
    """The prose lines between a page's first command block and its second."""
    lines = page.splitlines()
    fences = [i for i, ln in enumerate(lines) if ln.startswith("```")]
    return [ln for ln in lines[fences[1] + 1:fences[2]] if ln.strip() and not ln.startswith("#")]


def test_getting_started_leads_with_doing() -> None:
    """Issue 36, item 11: after the two commands the page went on for ~15 lines of internals (the
    managed worker's port, its runtime file, the socket hand-over) before the reader did anything
    with the running daemon; those moved to concepts/workers.md."""
    prose = prose_before_the_second_command((DOCS / "getting-started.md").read_text())
    assert len(prose) <= 8, prose
