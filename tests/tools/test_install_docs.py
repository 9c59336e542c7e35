"""The README's install line and version notes agree with pyproject.toml's extras and with
the scripts; docs/configuration.md documents every option."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from hma_redis.core.config import SECRETS_NOT_IN_EXTRA, RedisTierConfig

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _install_line() -> str:
    (line,) = [ln for ln in README.splitlines() if ln.startswith("pip install -e '.[vllm]'")]
    return line


def _minor_versions_allowed(requirement: Requirement) -> list[str]:
    return [f"0.{m}" for m in range(20, 60) if requirement.specifier.contains(f"0.{m}.0")]


def test_readme_install_line_names_what_each_extra_installs():
    line = _install_line()
    for extra in ("vllm", "cpu"):
        (spec,) = EXTRAS[extra]
        assert spec.replace(" ", "") in line.replace(" ", ""), (extra, spec, line)


def test_readme_says_what_is_tested_on_each_vllm_version_the_extra_allows():
    versions = _minor_versions_allowed(Requirement(EXTRAS["vllm"][0]))
    assert versions == ["0.32", "0.33"]
    rows = [ln for ln in README.splitlines() if re.match(r"\| 0\.\d+ ", ln)]
    assert [row.split()[1] for row in rows] == versions


def test_readme_says_how_to_skip_the_vllm_033_stage():
    assert "HMA_SKIP_VLLM_033=1 bash scripts/test.sh" in README
    assert "~10 GB" in README


def test_scripts_that_need_no_vllm_033_do_not_install_it():
    for script in ("demo.sh", "openai_example.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert 'HMA_SKIP_VLLM_033="${HMA_SKIP_VLLM_033:-1}" bash scripts/setup.sh' in text, script


def test_every_option_the_tier_accepts_has_a_row_in_the_configuration_reference():
    """docs/configuration.md is "every option" (the README says so): an option added to the
    config, as store_pending_timeout_s was, fails here until it is documented."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    # The secrets refused in the extra config have rows under their files and variables.
    fields = {f.name for f in dataclasses.fields(RedisTierConfig) if f.init}
    names = fields - {"url", *SECRETS_NOT_IN_EXTRA}
    missing = sorted(n for n in names | {"redis_url"} if f"\n| `{n}` |" not in doc)
    assert not missing, f"options without a row in docs/configuration.md: {missing}"
