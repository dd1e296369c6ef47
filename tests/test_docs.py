"""The documentation names only paths that exist, and cites reasons rather than tickets.

Which strings in README.md, docs/*.md and benchmarks/HISTORY.md count as repo paths
-----------------------------------------------------------------------------------
The docs write a path of this repository relative to the repository root, in backticks
(`storage/checkpoints.py`, `ops/worker.py:build_workers`, `deploy/k8s/`) or as a link
target relative to the document ([multinode](docs/multinode.md), [x](runspec.md) from docs/).
So the candidates are:

1. every markdown link target that is not a URL (`scheme://`, `mailto:`) or an in-page
   anchor (`#...`), resolved against the linking document's directory;
2. every whitespace-separated token of an inline code span whose first path component is
   a top-level directory of `git ls-files` (`common/…`, `docs/…`, `.ci/…`);
3. anywhere else in the text — prose and fenced command blocks — a token of the form
   `<tracked top-level directory>/…<known extension>` (`bash benchmarks/gpu_check.sh`).
   Prose needs the extension, since it also writes "storage/dataprep/trainer" for layers.

A token is then trimmed of what follows a path without being part of it: a `:symbol`
or `::test` suffix after the file name, a `#anchor`, trailing punctuation and quotes.

Not paths of this repository, so skipped: URLs; globs (`*`, `?`, `[`, `{`); placeholders
(`<run>`, `$NVME`); ellipses; and anything under `runs/` or `s3://`, which describe a
bucket's layout, not this tree. A bare top-level file name (`README.md`, `Makefile`) in
backticks is not taken for a path: rule 2 needs a directory, and links cover the rest.

A candidate exists when it is a tracked file, or a directory holding a tracked file.
"""

from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

REPO = Path(__file__).resolve().parent.parent

# Extensions a path in prose or a command block must end with to be taken for one (rule 3).
KNOWN_EXTENSIONS = ("py", "md", "sh", "json", "jsonl", "toml", "yaml", "yml", "png", "txt",
                    "html", "cfg")
# Bucket and store layouts the docs describe: not paths of this repository.
LAYOUT_PREFIXES = ("runs/", "s3://")
SKIP_CHARS = set("*?[]{}<>…") | {"$"}

FENCE = re.compile(r"^( {0,3})(```|~~~).*?^\1\2[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK_TARGET = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
TICKET = re.compile(r"issue [0-9]", re.I)


@lru_cache(maxsize=1)
def tracked() -> frozenset[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    return frozenset(p for p in out.split("\0") if p)


@lru_cache(maxsize=1)
def tracked_dirs() -> frozenset[str]:
    dirs: set[str] = set()
    for path in tracked():
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return frozenset(dirs)


def top_level_dirs() -> frozenset[str]:
    return frozenset(d for d in tracked_dirs() if "/" not in d)


def exists(path: str) -> bool:
    path = path.rstrip("/")
    return path in tracked() or path in tracked_dirs()


def trim(token: str) -> str:
    """The path in a token: no surrounding quotes or punctuation, no `:symbol` or `#anchor`."""
    token = token.strip("\"'“”‘’()[],;")
    token = token.split("#", 1)[0]
    # `file.py:name`, `file.py::test_x`: the file is the path.
    m = re.match(r"^(.*?\.[A-Za-z0-9]+)::?[A-Za-z_].*$", token)
    if m:
        token = m.group(1)
    return token.rstrip(".,;:)'\"")


def skipped(token: str) -> bool:
    return (
        not token
        or "://" in token
        or token.startswith(("mailto:", "#"))
        or token.startswith(LAYOUT_PREFIXES)
        or "..." in token
        or any(c in SKIP_CHARS for c in token)
    )


def candidates(doc: Path, text: str | None = None) -> list[str]:
    """Repo-root-relative paths `doc` names (its `text`, if given), by this module's rules."""
    if text is None:
        text = doc.read_text(encoding="utf-8")
    tops = top_level_dirs()
    found: list[str] = []

    # Rule 1: link targets, relative to the document.
    for m in LINK_TARGET.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if skipped(target) or ":" in target:
            continue
        resolved = (doc.parent / target).resolve()
        try:
            found.append(resolved.relative_to(REPO).as_posix())
        except ValueError:
            found.append(target)  # outside the repository: reported as missing

    # Rule 2: inline code spans (outside fenced blocks).
    fences = "\n".join(m.group(0) for m in FENCE.finditer(text))
    outside_fences = FENCE.sub("", text)
    for m in CODE_SPAN.finditer(outside_fences):
        for raw in m.group(2).split():
            token = trim(raw)
            if skipped(token) or "/" not in token:
                continue
            if token.split("/", 1)[0] in tops:
                found.append(token)

    # Rule 3: `<top dir>/…<ext>` anywhere else (prose, fenced blocks).
    rest = CODE_SPAN.sub(" ", outside_fences) + "\n" + fences
    ext = "|".join(KNOWN_EXTENSIONS)
    tops_re = "|".join(re.escape(t) for t in sorted(tops))
    pattern = re.compile(rf"(?<![\w./-])(?:{tops_re})/[\w./-]*\.(?:{ext})(?![\w/-])")
    for m in pattern.finditer(rest):
        token = trim(m.group(0))
        if not skipped(token):
            found.append(token)
    return found


def owned_docs() -> list[Path]:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return [*docs, REPO / "benchmarks" / "HISTORY.md"]


@pytest.mark.parametrize("doc", owned_docs(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_repo_path_a_doc_names_exists(doc: Path) -> None:
    missing = sorted({p for p in candidates(doc) if not exists(p)})
    assert not missing, f"{doc.relative_to(REPO)} names paths that are not in the repo: {missing}"


def test_the_path_extraction_finds_each_kind_of_mention() -> None:
    text = (
        "See `storage/checkpoints.py:CheckpointStore.commit` and [faults](faults.md),\n"
        "the folder `deploy/k8s/`, prose naming benchmarks/gpu_check.sh, a layer list\n"
        "storage/dataprep/trainer, `runs/<id>/RUN.json`, `s3://bucket/x.json`,\n"
        "`spec/<section>.py`, [web](https://example.com/a.md) and `python -m trainer.segment`.\n"
        "```sh\nbash benchmarks/scrub.py --quick\n```\n"
    )
    # As though the text were a page in docs/, so the relative link resolves there.
    found = sorted(set(candidates(REPO / "docs" / "probe.md", text)))
    assert found == [
        "benchmarks/gpu_check.sh",
        "benchmarks/scrub.py",
        "deploy/k8s/",
        "docs/faults.md",
        "storage/checkpoints.py",
    ]


def test_a_missing_path_is_reported() -> None:
    text = "The loop is in `trainer/no_such_module.py` (see [it](no_such_page.md))."
    found = candidates(REPO / "docs" / "probe.md", text)
    assert [p for p in found if not exists(p)] == [
        "docs/no_such_page.md",
        "trainer/no_such_module.py",
    ]


def test_no_tracked_doc_or_source_cites_a_ticket_number() -> None:
    """A reason is written out (or linked to its decision record), never "issue N"."""
    hits = []
    for rel in sorted(tracked()):
        if not rel.endswith((".md", ".py")):
            continue
        path = REPO / rel
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if TICKET.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not hits, f"{len(hits)} lines cite a ticket number:\n" + "\n".join(hits)


# The docs stay short: the README shows one current figure per benchmark row (history lives
# in benchmarks/HISTORY.md), design.md is reference by subsystem, decisions.md says what was
# chosen, over what and why. Counted as `wc -w` counts: whitespace-separated tokens.
WORD_LIMITS = {"README.md": 2_500, "docs/design.md": 10_000, "docs/decisions.md": 12_000}


def word_count(text: str) -> int:
    return len(text.split())


def test_word_count_counts_as_wc_does() -> None:
    # what `printf 'a  b\tc\n\nd — `e`\n' | wc -w` prints
    assert word_count("a  b\tc\n\nd — `e`\n") == 6


@pytest.mark.parametrize("rel", sorted(WORD_LIMITS))
def test_each_long_doc_stays_within_its_word_limit(rel: str) -> None:
    words = word_count((REPO / rel).read_text(encoding="utf-8"))
    limit = WORD_LIMITS[rel]
    assert words <= limit, (
        f"{rel} has {words} words (wc -w), over its limit of {limit}: move history to "
        f"benchmarks/HISTORY.md and repetition to the document that owns it"
    )
