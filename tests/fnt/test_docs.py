"""README.md, CHANGELOG.md and docs/*.md hold together: every relative link and #anchor
resolves, every `fnt` command and every config key is documented exactly once, and every module,
name and repository file the pages cite exists.

"Documented" means: a body row of a Markdown table (not its header) whose first cell is exactly
`` `fnt COMMAND` `` or `` `KEY` ``, or a heading whose whole text is that; README.md and
docs/*.md are searched. The commands are `fnt.__main__.COMMANDS`; the keys are those of the
generated key table (`fnt.config.markdown_keys`: RLConfig's, then DPOConfig's own)."""

from __future__ import annotations

import ast
import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

from fnt.__main__ import COMMANDS
from fnt.config import DPOConfig, RLConfig
from fnt.config.schema import all_keys

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CHANGELOG = ROOT / "CHANGELOG.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# The pages that document commands and keys (the changelog names what was, not what is).
MANUAL = [README, *DOCS]
PAGES = [*MANUAL, CHANGELOG]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A module or name of the code, `fnt.x.y` or `steps.x`, and a path of the repository.
DOTTED = re.compile(r"(?<![\w./-])((?:fnt|steps)(?:\.[A-Za-z_]\w*)+)")
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:fnt|steps|tests|scripts|examples|docs|tools|\.ci)/[\w./-]*[\w/])"
)


def without_code(text: str) -> str:
    """The text with fenced code blocks blanked out (line count kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation dropped, lower case, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors of a page's headings, a repeated one numbered as GitHub does (-1, -2)."""
    seen: Counter[str] = Counter()
    out = set()
    for _, text in HEADING.findall(without_code(page.read_text())):
        base = slug(text)
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return frozenset(out)


def links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", without_code(page.read_text()))
    return LINK.findall(text)


def body_rows(page: Path) -> list[str]:
    """The first cell of every body row of every table of the page, stripped."""
    cells, previous = [], ""
    in_body = False
    for line in without_code(page.read_text()).splitlines():
        line = line.strip()
        if not line.startswith("|"):
            in_body = False
        elif re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", line) and previous.startswith("|"):
            in_body = True
        elif in_body:
            cells.append(line.split("|")[1].strip())
        previous = line
    return cells


def documented(names: list[str], pages: list[Path] = MANUAL) -> Counter[str]:
    """How often each of `names` is a table row's first cell or a heading, over the pages."""
    counts: Counter[str] = Counter()
    for page in pages:
        headings = [text for _, text in HEADING.findall(without_code(page.read_text()))]
        for cell in body_rows(page) + headings:
            if cell in names:
                counts[cell] += 1
    return counts


def test_there_are_pages_to_check():
    names = {page.name for page in DOCS}
    assert {"configuration.md", "performance.md", "extending.md", "design.md"} <= names
    assert CHANGELOG.is_file()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or ROOT not in (file, *file.parents):
            bad.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            bad.append(f"{target}: no heading with the anchor #{anchor} in {file.name}")
    assert not bad, "\n".join(bad)


def test_the_slugs_are_githubs():
    assert slug("Answers from a checkpoint: `fnt generate`") == (
        "answers-from-a-checkpoint-fnt-generate"
    )
    assert slug("Benchmarks and the GPU check") == "benchmarks-and-the-gpu-check"
    assert slug("`loss.kind` and `rollout.engine`") == "losskind-and-rolloutengine"
    assert slug("Past one machine (torchrun, HSDP)") == "past-one-machine-torchrun-hsdp"


def test_every_command_is_documented_once():
    names = [f"`fnt {command}`" for command in COMMANDS]
    counts = documented(names)
    assert [n for n in names if counts[n] != 1] == [], f"documented this often: {dict(counts)}"
    rows = {c for page in MANUAL for c in body_rows(page) if re.fullmatch(r"`fnt [\w-]+`", c)}
    assert rows <= set(names), f"rows of commands fnt does not have: {rows - set(names)}"


def test_every_config_key_is_documented_once():
    keys = list({**all_keys(RLConfig), **all_keys(DPOConfig)})
    names = [f"`{key}`" for key in keys]
    counts = documented(names)
    missing = [n for n in names if counts[n] == 0]
    twice = [n for n in names if counts[n] > 1]
    assert not missing, f"not documented: {missing} (run: python scripts/update_readme.py)"
    assert not twice, f"documented more than once: {twice}"


FILE_SUFFIX = re.compile(r"\.(py|toml|md|json|jsonl|safetensors|png|sh|cpp)$")


def test_every_config_key_named_exists():
    """A code span naming a key (`loss.kind`, `--loss.ref-kl-tau 0.05`) names one the schema
    has, or a section of keys (`rollout.vllm`)."""
    keys = set(all_keys(RLConfig)) | set(all_keys(DPOConfig))
    sections = {key.split(".")[0] for key in keys if "." in key}
    bad = []
    for page in MANUAL:
        for span in CODE_SPAN.findall(without_code(page.read_text())):
            match = re.match(r"`(?:--)?([a-z_]+(?:\.[a-z_0-9-]+)+)", span)
            if not match or match.group(1).split(".")[0] not in sections:
                continue
            key = match.group(1).replace("-", "_")
            known = key in keys or any(k.startswith(key + ".") for k in keys)
            if not known and not FILE_SUFFIX.search(key):
                bad.append(f"{page.name}: {span}")
    assert not bad, "config keys the schema does not have:\n" + "\n".join(bad)


def test_documented_finds_rows_and_headings_but_not_headers_or_prose(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# `fnt sft`\n\nText naming `fnt rl` and `seed`.\n\n| `seed` | x |\n| --- | --- |\n"
        "| `seed` | y |\n| `fnt rl` | z |\n\n```\n| `fnt rl` | in code |\n```\n"
    )
    assert documented(["`fnt sft`", "`fnt rl`", "`seed`"], [page]) == Counter(
        {"`fnt sft`": 1, "`fnt rl`": 1, "`seed`": 1}
    )


@cache
def top_level_names(module: Path) -> frozenset[str]:
    """The names a module (a .py file, or a package's __init__.py) defines or imports, and the
    keys of its `_EXPORTS` (the names its `__getattr__` loads on first use)."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            names.update(targets)
            if "_EXPORTS" in targets and isinstance(node.value, ast.Dict):  # lazy exports
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """Whether `dotted` is a module of the code, or a module and a name it defines (with
    anything after the name, an attribute, taken on trust)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file() or (base.is_dir() and i == len(parts)):
            rest = parts[i:]
            return not rest or (module.is_file() and rest[0] in top_level_names(module))
    return False


@pytest.mark.parametrize("page", MANUAL, ids=lambda p: p.name)
def test_every_module_name_and_file_named_exists(page):
    text = without_code(page.read_text())
    names = sorted(set(DOTTED.findall(text)))
    assert [n for n in names if not resolves(n)] == [], f"{page.name} names what is not there"
    paths = sorted(set(REPO_PATH.findall(page.read_text())))
    assert [p for p in paths if not (ROOT / p).exists()] == [], f"{page.name}: no such files"


def test_a_name_that_is_gone_is_found():
    assert resolves("fnt.rollout.base") and resolves("fnt.config.engines.ENGINES")
    assert resolves("fnt.testing.WANDB_STUB") and resolves("steps.rl_losses.LOSS_KINDS")
    assert not resolves("fnt.rollout.base.score_groups") and not resolves("fnt.rewards")
