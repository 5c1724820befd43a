"""The README stays a five-minute read that CI can trust, and the docs' links land.

- README.md is at most 200 lines and has the two set-up commands exactly as .ci/run
  greps them;
- every row of its benchmark table has a figure, the command that produces it (in the
  command column, backticked: `python bench/...`, `vllm ...` or `raylm ...`, optionally
  after VAR=value settings) and the date it was measured; no other README line quotes a
  figure (tok/s, ms, a ratio like 1.41x) without a command beside it;
- every relative link in README.md and docs/*.md points to a file or folder that exists,
  and a link's #anchor to a heading of the page it names.
Each check has a test that feeds it a bad input, so it is known to fail when it should.
"""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_LINES = 200
# The "Set up" block, comments included; .ci/run runs the last line exactly as written.
SETUP = [
    "# 1. install and run the main job: serve SmolLM2-135M-Instruct (fetched once) on a local Ray",
    "pip install -e . && raylm serve",
    "# 2. run the tests",
    'pip install -e ".[dev]" && python -m pytest',
]
PAGES = ["serving.md", "deployment.md", "performance.md", "architecture.md", "contributing.md"]

COMMAND = re.compile(
    r"`(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:python\s+bench/[\w/]+\.py|vllm\s+\w|raylm\s+\w)[^`]*`")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# What a quoted measurement looks like: a rate, a latency, a ratio.
FIGURE = re.compile(r"\d\s*tok/s|\d\s*ms\b|\b\d+(?:\.\d+)?x\b")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


# ---- the pieces ------------------------------------------------------------------------------
def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    return FENCE.sub("", text).splitlines()


def benchmark_table(text: str) -> tuple[list[str], list[str]]:
    """(header cells, row lines) of the first table in the "## Benchmarks" section."""
    m = re.search(r"^## Benchmarks\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, "README has no '## Benchmarks' section"
    lines, table = m.group(1).splitlines(), []
    for line in lines:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    assert len(table) >= 3, "the Benchmarks section has no table"
    return _cells(table[0]), table[2:]


def _cells(line: str) -> list[str]:
    """A table row's cells; a "|" inside a code span is not a cell border."""
    masked = CODE_SPAN.sub(lambda m: "\0" * len(m.group(0)), line)
    bounds = [i for i, ch in enumerate(masked) if ch == "|"]
    return [line[a + 1:b].strip() for a, b in zip(bounds, bounds[1:])]


def row_problems(header: list[str], row: str) -> list[str]:
    """What a benchmark row lacks: the command beside its figures, or its date."""
    names = [h.lower() for h in header]
    if "command" not in names or "measured" not in names:
        return [f"the table's header {header} has no 'command' or 'measured' column"]
    cells = _cells(row)
    if len(cells) != len(header):
        return [f"{len(cells)} cells, the header has {len(header)}: {row}"]
    command, measured = cells[names.index("command")], cells[names.index("measured")]
    others = " ".join(c for i, c in enumerate(cells) if i != names.index("command"))
    problems = []
    if not re.search(r"\d", others):
        problems.append(f"no figure: {row}")
    if not COMMAND.search(command):
        problems.append(f"figures without their command (`python bench/...`, `vllm ...` or "
                        f"`raylm ...` in the command column): {row}")
    if not DATE.search(measured):
        problems.append(f"no date (YYYY-MM-DD) in the measured column: {row}")
    return problems


def figures_without_command(text: str) -> list[str]:
    return [line for line in prose_lines(text) if FIGURE.search(CODE_SPAN.sub("", line))
            and not COMMAND.search(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(text):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    bad = []
    for line in prose_lines(text):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                bad.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                bad.append(f"{path.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


# ---- the README ------------------------------------------------------------------------------
def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; keep it at most {MAX_LINES} (details go in docs/)"


def test_readme_has_the_setup_commands_exactly():
    lines = README.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line == SETUP[0]]
    assert any(lines[i:i + len(SETUP)] == SETUP for i in starts), (
        "README.md's Set up block must be, line for line:\n" + "\n".join(SETUP))
    # .ci/run: grep -qxF 'pip install -e ".[dev]" && python -m pytest' README.md
    assert SETUP[-1] in lines


def test_every_benchmark_row_has_its_command_and_date():
    header, rows = benchmark_table(README.read_text())
    assert len(rows) >= 5, f"the benchmark table has {len(rows)} rows"
    problems = [p for row in rows for p in row_problems(header, row)]
    assert problems == [], "\n".join(problems)


def test_no_readme_figure_without_its_command():
    assert figures_without_command(README.read_text()) == []


def test_readme_links_every_docs_page():
    text = README.read_text()
    missing = [p for p in PAGES if f"(docs/{p}" not in text]
    assert missing == [], f"README.md does not link {missing}"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_land(path):
    assert broken_links(path) == []


# ---- the checks themselves fail when they should ---------------------------------------------
HEADER = ["workload", "raylm", "reference", "raylm / ref", "measured", "command"]


def test_row_check_fails_on_a_figure_without_its_command():
    good = ("| w | 10 tok/s | vLLM 5 tok/s | 2.00x | 2026-12-01 | "
            "`RAYLM_NUM_THREADS=1 python bench/spec_decode.py --k 3` |")
    assert row_problems(HEADER, good) == []
    assert row_problems(HEADER, good.replace("`RAYLM_NUM_THREADS=1 python bench/spec_decode.py --k 3`", ""))
    assert row_problems(HEADER, good.replace("python bench/spec_decode.py", "bench it"))
    # A backticked `vllm serve` elsewhere in the row is not the row's command.
    assert row_problems(HEADER, "| w | 10 tok/s | `vllm serve` 5 tok/s | 2.00x | 2026-12-01 | |")
    assert row_problems(HEADER, good.replace("2026-12-01", "last week"))
    assert row_problems(HEADER[:-1], good)
    assert row_problems(HEADER, "| w | 10 | 5 | 2x | 2026-12-01 | `python bench/x.py` | extra |")
    # A "|" inside the command's code span does not split the cell.
    assert row_problems(HEADER, good.replace("--k 3", "--k 3 | tee log")) == []


def test_figure_check_fails_on_a_bare_figure():
    assert figures_without_command("raylm is 1.41x faster\n")
    assert figures_without_command("it serves 2066 tok/s\n")
    assert figures_without_command("TTFT 255 ms on the fixed workload\n")
    assert figures_without_command("2066 tok/s: `python bench/serve.py`\n") == []
    assert figures_without_command("```\nlog: 2066 tok/s\n```\n") == []
    assert figures_without_command("16 prompts x 64 tokens, TP=3, `--k 3`\n") == []


def test_link_check_fails_on_a_missing_file_or_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Serving: `bench/serve.py`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#serving-benchservepy) [web](https://example.org/x)\n"
                    "[self](#a-heading)\n\n## A heading\n\n`[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(page) == []
    page.write_text("[gone](missing.md) ![img](img/none.png) [bad](other.md#no-such)\n")
    assert len(broken_links(page)) == 3


def test_slug_matches_githubs():
    assert slug("Serving: `bench/serve.py`") == "serving-benchservepy"
    assert slug("3. Asynchronous scheduling — the ledger") == "3-asynchronous-scheduling--the-ledger"
    assert slug("The server: `raylm serve`") == "the-server-raylm-serve"
    assert anchors("## A\n## A\n") == {"a", "a-1"}
