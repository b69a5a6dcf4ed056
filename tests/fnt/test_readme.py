"""The generated tables of README.md and docs/ (layout, config keys, TRL names, resume policy,
public API, every module) are current, each in the one page that holds it; and README.md stays a
short start whose two commands run on a fresh clone."""

import re

from scripts.update_readme import DESIGN, PAGES, README, ROOT, block, with_tables

BLOCK_NAME = re.compile(r"<!-- ([a-z-]+):start -->")
GENERATED = {name for names in PAGES.values() for name in names}


def test_each_generated_table_is_current_and_in_its_page_only():
    pages = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        found = [name for name in BLOCK_NAME.findall(text) if name in GENERATED]
        assert sorted(found) == sorted(PAGES.get(page, ())), f"{page.name} holds {found}"
        for name in found:
            assert block(name).search(text), f"{page.name}: {name}:end is missing"
        assert text == with_tables(text), "run: python scripts/update_readme.py"


def test_the_design_notes_list_every_module():
    text = DESIGN.read_text()
    assert "`state.py`" in text and "`wandb.py`" in text and "`adamw.cpp`" in text


def test_the_readme_starts_with_the_two_commands_and_each_sets_up_first():
    text = README.read_text()
    start = text.index("\n## Start here: two commands\n")
    commands = re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)
    assert [line.split("#")[0].strip() for line in commands.splitlines()] == [
        "make demo",
        "make test",
    ]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: \$\(VENV\)/\.installed$", makefile, re.M)  # the venv, then the demo
    assert re.search(r"^test: setup$", makefile, re.M)
    assert re.search(r"^part \"make test\" make test$", (ROOT / ".ci" / "run").read_text(), re.M)


def test_the_readme_stays_a_start_not_the_manual():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, "move the detail into a page of docs/ and link it"
    assert not any(line.startswith("#### ") for line in lines)
