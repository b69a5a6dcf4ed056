"""The generated parts of README.md (config keys, resume policy, public API, layout) and of
docs/design.md (every module) must stay current."""

from scripts.update_readme import DESIGN, README, with_modules, with_tables


def test_readme_tables_are_current():
    text = README.read_text()
    for block in ("api", "config-keys", "resume-policy", "layout"):
        assert f"<!-- {block}:start -->" in text
    assert text == with_tables(text), "run: python scripts/update_readme.py"


def test_the_design_notes_list_every_module():
    text = DESIGN.read_text()
    assert "<!-- modules:start -->" in text
    assert text == with_modules(text), "run: python scripts/update_readme.py"
    assert "`state.py`" in text and "`wandb.py`" in text and "`adamw.cpp`" in text
