"""Every design reference in the code ("docs/architecture.md §4", "§3 rule 5", "rule 2")
lands on a section heading or a numbered rule of docs/architecture.md, and the README
links the document."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"
# The only numbered rule list is the ledger's: a bare "rule N" means §3 rule N.
DEFAULT_RULE_SECTION = 3
_SKIP_DIRS = {"build", "dist", "node_modules", "kuberay-crds"}
_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".tpl", ".toml", ".txt"}

_HEADING = re.compile(r"^## (\d+)\. ", re.M)
_NUMBERED = re.compile(r"^(\d+)\. ", re.M)
_NUMS = r"\d+(?:\s*(?:,|and|or|-)\s*\d+)*"
# "§3 rule 5", "§3, rule 6", "§3 rules 1-4", "§4", "rule 2", "Rules 1 and 3".
_REF = re.compile(rf"§(\d+)(?:,?\s+rules?\s+({_NUMS}))?|\b[Rr]ules?\s+({_NUMS})")


def doc_index(text: str) -> dict[int, set[int]]:
    """Section number -> the numbers of the list items at the start of a line in it."""
    heads = list(_HEADING.finditer(text))
    index = {}
    for i, h in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = text[h.end():end]
        index[int(h.group(1))] = {int(m.group(1)) for m in _NUMBERED.finditer(body)}
    return index


def _numbers(spec: str) -> list[int]:
    nums = [int(n) for n in re.findall(r"\d+", spec)]
    if "-" in spec and len(nums) == 2:
        return list(range(nums[0], nums[1] + 1))
    return nums


def references(text: str) -> list[tuple[int, int | None, str]]:
    """(section, rule or None, matched text) for every reference in ``text``."""
    found = []
    for m in _REF.finditer(text):
        if m.group(1):
            section = int(m.group(1))
            rules = _numbers(m.group(2)) if m.group(2) else [None]
        else:
            section = DEFAULT_RULE_SECTION
            rules = _numbers(m.group(3))
        found += [(section, r, m.group(0)) for r in rules]
    return found


def _project_files() -> list[pathlib.Path]:
    files = []
    for p in REPO.rglob("*"):
        rel = p.relative_to(REPO)
        if (p.is_file() and p.suffix in _SUFFIXES and p != DOC
                and not any(part.startswith(".") or part in _SKIP_DIRS or part.endswith("egg-info")
                            for part in rel.parts)):
            files.append(p)
    return files


def test_reference_parser():
    text = ("see docs/architecture.md §4; (§3, rule 6) and §3 rules 1-3; rule 5: x; "
            "Rules 2 and 4; test_rule1_name; the rule applies")
    assert references(text) == [
        (4, None, "§4"), (3, 6, "§3, rule 6"), (3, 1, "§3 rules 1-3"), (3, 2, "§3 rules 1-3"),
        (3, 3, "§3 rules 1-3"), (3, 5, "rule 5"), (3, 2, "Rules 2 and 4"),
        (3, 4, "Rules 2 and 4")]
    index = doc_index("# T\n## 3. Ledger\n1. a\n   2. not a rule\n2. b\n## 4. PP\n1. c\n")
    assert index == {3: {1, 2}, 4: {1}}


def test_document_has_the_sections_and_rules_the_code_cites():
    index = doc_index(DOC.read_text())
    assert set(range(1, 11)) <= set(index), f"sections found: {sorted(index)}"
    assert index[DEFAULT_RULE_SECTION] >= set(range(1, 9)), index[DEFAULT_RULE_SECTION]


def test_every_reference_in_the_code_resolves():
    index = doc_index(DOC.read_text())
    files = _project_files()
    assert any(p.suffix == ".py" for p in files)
    dangling = []
    for path in files:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for section, rule, what in references(line):
                if section not in index or (rule is not None and rule not in index[section]):
                    dangling.append(f"{path.relative_to(REPO)}:{lineno}: {what!r}")
    assert dangling == [], f"references with no section/rule in {DOC.name}: {dangling}"


def test_the_documents_file_links_exist():
    missing = [target for target in re.findall(r"\]\((\.\./[^)#]+)\)", DOC.read_text())
               if not (DOC.parent / target).exists()]
    assert missing == [], f"links in {DOC.name} to files that do not exist: {missing}"


def test_readme_links_the_document():
    assert "(docs/architecture.md)" in (REPO / "README.md").read_text()
