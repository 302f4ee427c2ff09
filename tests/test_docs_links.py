"""Every link and repository path in the docs points into the tree.

Read: ``README.md``, ``config/README.md``, ``docs/*.md``, ``archive/*.md``,
``perf/README.md`` and ``tools/README.md``. Checked:

- every relative Markdown link (inline ``[text](target)``, images, and
  reference definitions ``[id]: target``) outside code: the target, relative
  to the document, exists; a ``#fragment`` names a heading of the target (or
  of the document itself) by GitHub's anchor rules;
- every repository path in code (inline code spans and fenced blocks, so
  commands too) that starts with one of :data:`TOP` (``tools/``,
  ``scripts/``, ``mlemlib/``, ...): it exists relative to the repository
  root; a placeholder (``<name>``, ``{matrix}``, ``*``) matches at least one
  path.

A failure names the document, the line and the missing target.
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [REPO / "README.md", REPO / "config" / "README.md", REPO / "perf" / "README.md", REPO / "tools" / "README.md"]
    + list((REPO / "docs").glob("*.md"))
    + list((REPO / "archive").glob("*.md"))
)
#: Top-level directories of the tree whose paths are checked where code names them.
TOP = ("tools", "scripts", "mlemlib", "perf", "docs", "config", "rules", "tests", "envs", "profiles", "archive", "requirements", ".ci")

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.DOTALL)
GIT_SHOW = re.compile(r"git\s+show\s+(?P<rev>[0-9a-f]{7,40}(?:[~^]\d*)*):(?P<path>[^\s`'\"]+)")
#: Documents of the project's own making that are not in the repository.
INTERNAL = re.compile(r"\b(?:DESIGN|STYLE|PERFORMANCE)\.md\b|/work/shared\b")
REPO_PATH = re.compile(r"(?<![\w./@~:$-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[^\s`'\"|,;()\[\]]*)")
PLACEHOLDER = re.compile(r"<[^>/]*>|\{[^}/]*\}|\.\.\.|\*+|\$\w+|\$\{[^}]*\}")


def rel(path: Path, repo: Path = REPO) -> str:
    """A path relative to the repository root, for messages."""
    try:
        return str(path.relative_to(repo))
    except ValueError:
        return str(path)


def split_code(lines: list[str]) -> Iterator[tuple[int, str, bool]]:
    """``(line number, line, inside a fenced block)`` for each line of a document."""
    fence: str | None = None
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if m is not None and (fence is None or m.group(1) == fence):
            fence = m.group(1) if fence is None else None
            yield n, line, True
            continue
        yield n, line, fence is not None


def slug(text: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger's rules, markup removed first)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("**", "").replace("__", "")
    text = re.sub(r"(?<!\w)\*(?!\s)|(?<!\s)\*(?!\w)", "", text)
    out = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in "-_ " or cat[0] in "LNM":
            out.append(ch)
    return "".join(out).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file (duplicates numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line, code in split_code(path.read_text(encoding="utf-8").splitlines()):
        if code or (m := HEADING.match(line)) is None:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return frozenset(out)


def check_link(doc: Path, target: str, repo: Path = REPO) -> str | None:
    """The fault of one relative link target, or None if it resolves."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
        return None  # https:, mailto:, ...
    path_part, _, fragment = target.partition("#")
    path_part = re.sub(r"\?.*$", "", path_part)
    if path_part.startswith("/"):
        return f"link {target!r}: an absolute path (use a path relative to {rel(doc, repo)})"
    dest = (doc.parent / path_part).resolve() if path_part else doc
    if not dest.exists():
        return f"link {target!r}: {rel(dest, repo)} does not exist"
    if repo not in dest.parents and dest != repo:
        return f"link {target!r}: {dest} is outside the repository"
    if fragment and dest.suffix == ".md" and dest.is_file() and fragment.lower() not in anchors(dest):
        return f"link {target!r}: {rel(dest, repo)} has no heading with anchor #{fragment}"
    return None


def check_repo_path(token: str, repo: Path = REPO, output: bool = False) -> str | None:
    """The fault of one repository path named in code, or None if it exists.

    ``output``: the path follows ``--out``, ``-o`` or ``>``: the command makes
    it, so only its parent directory must exist.
    """
    path = re.sub(r"(?<=\.\w)(?::\d+(?:-\d+)?|::\S*)$", "", token)  # file.py:12, test.py::test_x
    path = path.rstrip(".:")
    if output:
        path = str(Path(path.rstrip("/")).parent)
    if PLACEHOLDER.search(path):
        pattern = PLACEHOLDER.sub("*", path).rstrip("/")
        if any(repo.glob(pattern)):
            return None
        return f"path {token!r}: nothing in the tree matches {pattern!r}"
    if (repo / path).exists():
        return None
    return f"path {token!r}: {path} does not exist"


@cache
def git_history(repo: Path) -> bool:
    """Whether ``repo`` is a git checkout with its whole history (not shallow)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--is-shallow-repository"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return out == "false"


def check_git_show(rev: str, path: str, repo: Path = REPO) -> str | None:
    """The fault of a ``git show REV:PATH`` command, or None if the history holds that path."""
    if not git_history(repo):
        return None  # no history to look in (a shallow clone, an exported tree)
    proc = subprocess.run(
        ["git", "-C", str(repo), "cat-file", "-e", f"{rev}:{path.rstrip('/')}"],
        capture_output=True, text=True, timeout=30,
    )
    return None if proc.returncode == 0 else f"command 'git show {rev}:{path}': the history has no {path} at {rev}"


def code_faults(code: str, repo: Path, paths: bool) -> list[tuple[int, str]]:
    """``(offset, fault)`` of the paths (where ``paths``) and ``git show`` commands in one piece of code."""
    found = [(m.start(), check_git_show(m["rev"], m["path"], repo)) for m in GIT_SHOW.finditer(code)]
    if paths:
        for m in REPO_PATH.finditer(code):
            before = code[: m.start()].rstrip()
            output = re.search(r"(?:^|\s)(?:--out|--output|--output-file|-o|>)$", before) is not None
            found.append((m.start(), check_repo_path(m.group(1), repo, output)))
    return [(pos, f) for pos, f in found if f]


def line_of(text: str, pos: int) -> int:
    """1-based line number of an offset in a text."""
    return text.count("\n", 0, pos) + 1


def faults(doc: Path, repo: Path = REPO, paths: bool = True) -> list[str]:
    """Every broken link, missing repository path and stale citation in one document.

    Parameters
    ----------
    doc
        The Markdown file.
    repo
        The repository root that repository paths are relative to.
    paths
        Whether to check repository paths named in code and citations of
        documents outside the repository (False for the archive, a record
        kept as written, of files that were removed since).

    Returns
    -------
    list of str
        ``"doc:line: fault"`` lines, in the document's order.
    """
    lines = doc.read_text(encoding="utf-8").splitlines()
    out: list[tuple[int, str]] = []
    prose_lines = []
    for n, line, code in split_code(lines):
        if code:
            out += [(n, f) for _, f in code_faults(line, repo, paths)]
            prose_lines.append("")
        else:
            prose_lines.append(line)
    prose = "\n".join(prose_lines)
    # Code spans may run over a line break (not over a blank line).
    for m in CODE_SPAN.finditer(prose):
        found = code_faults(m.group(2).replace("\n", " "), repo, paths)
        out += [(line_of(prose, m.start(2) + pos), f) for pos, f in found]
    text = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
    for m in INLINE_LINK.finditer(text):
        out.append((line_of(text, m.start()), check_link(doc, m.group(1), repo) or ""))
    for n, line in enumerate(text.split("\n"), 1):
        if (m := REF_DEF.match(line)) is not None:
            out.append((n, check_link(doc, m.group(1), repo) or ""))
        for m in INTERNAL.finditer(line) if paths else ():
            out.append((n, f"{m.group(0)!r}: a document outside the repository (state what it says instead)"))
    return [f"{rel(doc, repo)}:{n}: {f}" for n, f in sorted(out, key=lambda x: x[0]) if f]


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_links_and_paths_resolve(doc: Path) -> None:
    """The document's relative links, anchors and repository paths all point into the tree."""
    problems = faults(doc, paths=doc.parent.name != "archive")
    assert not problems, "\n".join(problems)


# The checker itself, on small documents written here.


def write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_slug_follows_github_rules() -> None:
    assert slug("Running a stage by hand") == "running-a-stage-by-hand"
    assert slug("After an interrupted `snakemake`") == "after-an-interrupted-snakemake"
    assert slug("GPU leases: concurrent jobs never share a GPU") == "gpu-leases-concurrent-jobs-never-share-a-gpu"
    assert slug("OSEM, factors and background") == "osem-factors-and-background"
    assert slug("The `run_mlem` rule (**fast**)") == "the-run_mlem-rule-fast"
    assert slug("A [link](x.md) in a heading") == "a-link-in-a-heading"
    assert slug("1 × H200 vs. 2") == "1--h200-vs-2"


def test_checker_reports_missing_file_anchor_and_path(tmp_path: Path) -> None:
    write(tmp_path, "tools/run.sh", "")
    write(tmp_path, "docs/b.md", "# Title\n\n## Setting up\n\n## Setting up\n")
    doc = write(
        tmp_path,
        "docs/a.md",
        "# A\n"
        "[ok](b.md#setting-up) and [second](b.md#setting-up-1) and [self](#a)\n"
        "[gone](missing.md) and [bad anchor](b.md#nowhere)\n"
        "`bash tools/run.sh` and `tools/gone.py`\n"
        "```\n"
        "python tools/h5_filters/bench.py x.h5\n"
        "[not a link](nowhere.md)\n"
        "```\n"
        "[web](https://example.org/tools/x) `docs/<name>.md` `docs/{x}.md` `tools/*.py`\n"
        "[abs](/etc/passwd)\n"
        "[ref]: ../tools/nothing.sh\n"
        "a span over a line break: `python\ntools/split.py` and `mlem x --out tools/new.h5`,\n"
        "`mlem x -o nowhere/new.h5`, as DESIGN.md says\n",
    )
    problems = faults(doc, tmp_path)
    joined = "\n".join(problems)
    assert "docs/a.md:3: link 'missing.md': docs/missing.md does not exist" in problems
    assert "docs/a.md:3: link 'b.md#nowhere': docs/b.md has no heading with anchor #nowhere" in problems
    assert "docs/a.md:4: path 'tools/gone.py': tools/gone.py does not exist" in problems
    assert "docs/a.md:6: path 'tools/h5_filters/bench.py': tools/h5_filters/bench.py does not exist" in problems
    assert "docs/a.md:9: path 'tools/*.py': nothing in the tree matches 'tools/*.py'" in problems
    assert any(p.startswith("docs/a.md:10: link '/etc/passwd': an absolute path") for p in problems)
    assert "docs/a.md:11: link '../tools/nothing.sh': tools/nothing.sh does not exist" in problems
    assert "docs/a.md:13: path 'tools/split.py': tools/split.py does not exist" in problems
    assert "docs/a.md:14: 'DESIGN.md': a document outside the repository (state what it says instead)" in problems
    # Resolving ones are not reported: b.md's anchors (the duplicate numbered), #a, tools/run.sh,
    # the link inside the fence, the URL, the placeholders that match, --out into tools/.
    # -o nowhere/new.h5 is not a repository path (nowhere/ is not a top-level directory checked).
    assert len(problems) == 9, joined
    # The archive: links only.
    assert [p for p in faults(doc, tmp_path, paths=False) if "path '" in p or "DESIGN" in p] == []


def test_output_paths_need_only_their_directory(tmp_path: Path) -> None:
    write(tmp_path, "perf/results/a/x.csv", "")
    assert check_repo_path("perf/results/h100x4", tmp_path, output=True) is None
    assert check_repo_path("perf/results/h100x4", tmp_path) == "path 'perf/results/h100x4': perf/results/h100x4 does not exist"
    assert check_repo_path("perf/nothing/h100x4", tmp_path, output=True) is not None


@pytest.mark.skipif(not git_history(REPO), reason="needs the repository's whole git history")
def test_git_show_commands_are_checked_against_the_history() -> None:
    assert check_git_show("8126159^", "tools/h5_filters/bench.py") is None
    fault = check_git_show("8126159^", "tools/no_such_probe.py")
    assert fault == "command 'git show 8126159^:tools/no_such_probe.py': the history has no tools/no_such_probe.py at 8126159^"
    assert code_faults("git show 8126159^:tools/no_such_probe.py > x.py", REPO, paths=True) == [(0, fault)]
