"""The README's config-key table is generated from the dataclasses and must stay current."""

from scripts.update_readme_keys import README, with_keys


def test_readme_lists_every_config_key():
    text = README.read_text()
    assert text == with_keys(text), "run: python scripts/update_readme_keys.py"
