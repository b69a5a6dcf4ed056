"""The README's generated tables (config keys, public API) must stay current."""

from scripts.update_readme import README, with_tables


def test_readme_tables_are_current():
    text = README.read_text()
    assert "<!-- api:start -->" in text and "<!-- config-keys:start -->" in text
    assert text == with_tables(text), "run: python scripts/update_readme.py"
