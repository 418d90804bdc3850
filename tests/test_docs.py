"""README.md and docs/*.md name only what exists. Every repository path they show (in backticks, in fenced code
blocks or as a link target), every figure name, every `kvshot` subcommand and its flags, every
`python -m kvshot_lib.reference` flag, every `--profile` and every `make` target is checked against the checkout,
the command line's own parsers and the Makefile; README.md stays a front page of at most 12,500 bytes.

Nothing heavy runs: the parsers are captured as ``main`` builds them, before any argument is parsed."""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import re
import shlex
from pathlib import Path

import pytest

from kvshot_lib import runner

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
README_MAX_BYTES = 12_500
DOCS = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]

KNOWN_EXTENSIONS = (
    ".py", ".csv", ".json", ".jsonl", ".md", ".yaml", ".yml", ".ipynb", ".png", ".pdf", ".toml", ".txt",
    ".safetensors", ".gz", ".sh",
)  # fmt: skip

# Outputs that runs, set-up or a shown command write, all git-ignored (.gitignore): the docs name them as places
# to look after running something, so they are not in a checkout. Absolute paths (/tmp/..., /path/to/...) are
# never repository files either.
IGNORED_OUTPUTS = (
    "runs/",  # executed notebooks, result tables, trained drafters, logs
    "data/cache/",  # converted model, tokenized data, feature stores, cost models
    ".venv/",  # make setup
    ".venv-serve/",  # make interop-env
    "figures/smoke/",  # figures/* is ignored except figures/default/ and figures/reference/: other profiles'
    "figures/qwen3-8b/",  # figures are written by running them
)
# Folders that were committed and replaced; the docs show the `git checkout <commit> -- <folder>` that restores them.
FROM_HISTORY = ("checkpoints/reference/",)  # the reference run's checkpoints, replaced by the on-policy run's
# Tokens with a slash that are not paths.
NOT_PATHS = {"Qwen/Qwen3-8B"}  # a Hugging Face model id
# Flags whose value is a place a command writes to (checked as output, not as an existing file).
OUTPUT_FLAGS = {"--out", "--root", ">", ">>"}
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1"}
TRACKER_RE = re.compile(r"\b(issue|stop|ticket|PR)[ #-]?\d+\b", re.I)
# a fenced block, also one indented in a list item
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)


# --- what the docs name ----------------------------------------------------------------------------------


def split_code(text: str) -> tuple[list[str], list[str], str]:
    """(code chunks, link targets, prose): each fenced block's logical lines (comments and line continuations
    folded) and each inline code span are chunks."""
    chunks = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            chunks.append(re.sub(r"(^|\s)#.*", "", line))
    prose = FENCE.sub("", text)
    chunks += [c for c in re.findall(r"`([^`]+)`", prose) if "\n\n" not in c]
    links = re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", prose))
    return chunks, links, prose


def tokens(chunk: str) -> list[str]:
    try:
        parts = shlex.split(chunk, posix=True)
    except ValueError:  # an unbalanced quote in prose code: plain whitespace split
        parts = chunk.split()
    out = []
    for p in parts:
        out += [t.strip(",:;[]") for t in re.split(r"[\"'()=\[\]]+", p) if t.strip(",:;[]")]
    return out


def commands(chunk: str) -> list[list[str]]:
    """The chunk's commands: its tokens cut at shell operators (pipes, ``&&``, redirections, ``&``)."""
    try:
        parts = shlex.split(chunk, posix=True)
    except ValueError:
        parts = chunk.split()
    out, current = [], []
    for p in parts:
        if p in SHELL_OPERATORS or p.startswith(("2>", ">")):
            out.append(current)
            current = []
        else:
            current.append(p.strip("[]"))
    return [c for c in [*out, current] if c]


def expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [
        e
        for alt in m.group(1).split(",")
        for e in expand_braces(pattern[: m.start()] + alt + pattern[m.end() :])
    ]


def _basenames() -> set[str]:
    skip = {".git", ".venv", ".venv-serve", "runs", "cache", "__pycache__", ".pytest_cache", ".ruff_cache"}
    names = set()
    for _root, dirs, files in os.walk(REPO_ROOT):
        dirs[:] = [d for d in dirs if d not in skip]
        names.update(files)
    return names


def path_problem(token: str, basenames: set[str]) -> str | None:
    """Why ``token`` names no file of the checkout, or None (it exists, is not a path, or is a known output)."""
    if "..." in token or "…" in token or "://" in token or token in NOT_PATHS:
        return None  # an elided pattern (`..._amd-epyc-2cores.json`) or a URL
    if token.startswith("../"):  # papermill --cwd notebooks: paths relative to notebooks/
        token = os.path.normpath("notebooks/" + token)
    if re.fullmatch(r"\d\d_[a-z0-9_*]+", token):  # a figure name (`03_mat_by_drafter`, `04_query_*`)
        figures = glob.glob(str(REPO_ROOT / "figures" / "*" / f"{token}.png"))
        notebooks = glob.glob(str(REPO_ROOT / "notebooks" / f"{token}.ipynb"))
        return None if figures or notebooks else "no such figure or notebook"
    is_path = re.fullmatch(r"[\w.<>{}*,@-]*(/[\w.<>{}*,@-]*)+", token) and re.search(r"\w", token)
    if not is_path and not token.endswith(KNOWN_EXTENSIONS):
        return None
    if token.startswith("/") or (token.rstrip("/") + "/").startswith(IGNORED_OUTPUTS + FROM_HISTORY):
        return None
    if not re.fullmatch(r"[\w.<>{}*,@/-]+", token):
        return None  # not a file name (prose inside backticks)
    for candidate in expand_braces(re.sub(r"<[^>]*>", "*", token)):
        if "/" not in candidate.rstrip("/"):  # a bare file name: some file of the checkout has it
            if not glob.has_magic(candidate) and candidate.rstrip("/") not in basenames:
                if not (REPO_ROOT / candidate).exists():
                    return "no file of that name in the checkout"
            continue
        if not glob.glob(str(REPO_ROOT / candidate)):
            return "does not exist"
    return None


def missing_paths(text: str, basenames: set[str]) -> list[str]:
    chunks, _, _ = split_code(text)
    wrong = []
    for chunk in chunks:
        toks = tokens(chunk)
        for before, tok in zip(["", *toks], toks):
            if before in OUTPUT_FLAGS:
                continue  # a place the command writes
            if before == "--profile" and tok.endswith(".yaml"):
                continue  # the reader's own profile file (`kvshot run --profile my_profile.yaml`)
            why = path_problem(tok, basenames)
            if why:
                wrong.append(f"`{tok}` ({why})")
    return wrong


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(md: Path) -> set[str]:
    _, _, prose = split_code(md.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6}\s+(.*)$", prose, re.M)}


def broken_links(text: str, md: Path) -> list[str]:
    """The links of ``text`` (the content of ``md``) whose file, or heading anchor in it, does not exist."""
    _, links, _ = split_code(text)
    wrong = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        target, _, anchor = link.partition("#")
        path = (md.parent / target).resolve() if target else md
        if not path.exists():
            wrong.append(f"({link}): no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            wrong.append(f"({link}): no heading with that anchor in {path.name}")
    return wrong


# --- the command line, as its own parsers define it ------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def capture_parser(main) -> argparse.ArgumentParser:
    """The parser ``main`` builds, taken at its first ``parse_args`` (nothing runs)."""

    def stop(self, *args, **kwargs):
        raise _Captured(self)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        with pytest.raises(_Captured) as caught:
            main([])
    return caught.value.parser


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


@pytest.fixture(scope="module")
def cli_parsers():
    from kvshot_lib import cli

    reference_main = importlib.import_module(
        "kvshot_lib.reference.__main__"
    )  # `python -m kvshot_lib.reference`

    kvshot = capture_parser(cli.main)
    reference = capture_parser(reference_main.main)
    (sub,) = [a for a in kvshot._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices), reference


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO_ROOT / "Makefile").read_text(), re.M))


def command_problems(text: str, subcommands: dict, reference: argparse.ArgumentParser) -> list[str]:
    chunks, _, _ = split_code(text)
    profiles = set(runner.available_profiles())
    targets = make_targets()
    wrong = []
    for chunk in chunks:
        for cmd in commands(chunk):
            for i, tok in enumerate(cmd):
                rest = None
                if os.path.basename(tok) == "kvshot" or (
                    tok == "-m" and cmd[i + 1 : i + 2] == ["kvshot_lib.cli"]
                ):
                    j = i + 1 if tok != "-m" else i + 2
                    if j >= len(cmd) or cmd[j].startswith("-") or cmd[j] in ("...", "<subcommand>"):
                        continue
                    name = cmd[j]
                    if name not in subcommands:
                        wrong.append(f"`kvshot {name}`: no such subcommand (has {sorted(subcommands)})")
                        continue
                    parser, rest, label = subcommands[name], cmd[j + 1 :], f"kvshot {name}"
                elif tok == "-m" and cmd[i + 1 : i + 2] == ["kvshot_lib.reference"]:
                    parser, rest, label = reference, cmd[i + 2 :], "python -m kvshot_lib.reference"
                elif tok == "make" and i + 1 < len(cmd) and not cmd[i + 1].startswith("-"):
                    if cmd[i + 1] not in targets:
                        wrong.append(f"`make {cmd[i + 1]}`: no such Makefile target")
                    continue
                if rest is None:
                    continue
                known = options(parser)
                for before, arg in zip(["", *rest], rest):
                    flag = arg.split("=", 1)[0]
                    if flag.startswith("--") and flag not in known:
                        wrong.append(f"`{label} {flag}`: no such option")
                    if before == "--profile" and not arg.endswith(".yaml") and arg not in profiles:
                        wrong.append(f"`{label} --profile {arg}`: no such profile (has {sorted(profiles)})")
                break  # one command per operator-separated part
    return wrong


# --- the tests -------------------------------------------------------------------------------------------


def test_docs_exist_and_readme_links_them():
    names = [d.name for d in DOCS[1:]]
    assert len(names) >= 5, f"docs/ should hold the moved sections, found {names}"
    linked = set(re.findall(r"\(docs/([\w.-]+\.md)", README.read_text()))
    assert set(names) <= linked, f"README.md does not link {sorted(set(names) - linked)}"


def test_readme_is_a_front_page():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size:,} bytes; move detail into docs/ (limit {README_MAX_BYTES:,})"
    )
    first_screen = README.read_text()[:3000]
    assert "make demo" in first_screen and "make test" in first_screen


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_named_path_exists(md):
    text = md.read_text()
    wrong = missing_paths(text, _basenames()) + broken_links(text, md)
    assert not wrong, f"{md.relative_to(REPO_ROOT)} names what is not in the checkout:\n" + "\n".join(wrong)


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_named_command_exists(md, cli_parsers):
    subcommands, reference = cli_parsers
    wrong = command_problems(md.read_text(), subcommands, reference)
    assert not wrong, f"{md.relative_to(REPO_ROOT)} names commands that do not exist:\n" + "\n".join(wrong)


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_internal_tracker_numbers(md):
    found = sorted({m.group(0) for m in TRACKER_RE.finditer(md.read_text())})
    assert not found, f"{md.relative_to(REPO_ROOT)} names tracker numbers a reader cannot look up: {found}"


def test_the_checks_catch_what_is_missing(cli_parsers):
    """The checkers above flag a made-up path, link, figure, subcommand, flag, profile and make target."""
    subcommands, reference = cli_parsers
    text = (
        "See `kvshot_lib/no_such_module.py`, `figures/default/data/no_such_table.csv`, `no_such_table.csv`,\n"
        "`09_no_such_figure` and [a page](docs/no_such_page.md), but not `runs/default/anything.csv`.\n\n"
        "```bash\nkvshot frobnicate --profile default\nkvshot run --no-such-flag\n"
        "python -m kvshot_lib.reference --profile no_such_profile\nmake no-such-target\n```\n"
    )
    paths = missing_paths(text, _basenames())
    assert [p.split("`")[1] for p in paths] == [
        "kvshot_lib/no_such_module.py",
        "figures/default/data/no_such_table.csv",
        "no_such_table.csv",
        "09_no_such_figure",
    ]
    assert broken_links(text, README) == ["(docs/no_such_page.md): no such file"]
    assert broken_links("[front page](README.md#two-commands) [x](README.md#no-such-heading)", README) == [
        "(README.md#no-such-heading): no heading with that anchor in README.md"
    ]
    found = command_problems(text, subcommands, reference)
    assert any("kvshot frobnicate" in w for w in found)
    assert any("--no-such-flag" in w for w in found)
    assert any("no_such_profile" in w for w in found)
    assert any("make no-such-target" in w for w in found)
    assert not command_problems("`kvshot figures --profile reference`", subcommands, reference)
    in_a_list = (
        "1. Build it:\n\n   ```bash\n   make no-such-listed-target\n   ```\n\n"
        "   Then `kvshot figures` may make room for `checkpoints/`.\n"
    )
    assert command_problems(in_a_list, subcommands, reference) == [
        "`make no-such-listed-target`: no such Makefile target"
    ]
