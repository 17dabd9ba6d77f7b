"""docs/DEPLOY.md lists every setting with its environment variable, generated from the model."""

from __future__ import annotations

from scripts import gen_settings_doc as gen
from scripts.deploy_check.policy import known_env_vars


def test_settings_table_is_in_sync() -> None:
    text = gen.DOC.read_text()
    assert gen.updated(text) == text, "run: python -m scripts.gen_settings_doc"


def test_table_names_every_env_variable() -> None:
    table = gen.render_table()
    for name in known_env_vars():
        assert f"`{name}`" in table
    assert "ENABLE_UNIFIED_RADIX_TREE" in table


def test_stale_table_is_detected() -> None:
    text = gen.DOC.read_text()
    stale = text.replace("`DECODE_WORKER_SERVER__PORT`", "`DECODE_WORKER_SERVER__PORTX`")
    assert gen.updated(stale) != stale
