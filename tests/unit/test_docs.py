"""The docs stay in step with the code: the README stays short and quotes only figures that
benchmark/RESULTS.md holds, docs/options.md lists every option and environment switch, and
docs/architecture.md names every extension and only modules that exist."""

from __future__ import annotations

import dataclasses
import pkgutil
import re
from pathlib import Path

import minisgl.extensions
from minisgl import env
from minisgl.cli import build_parser
from minisgl.config import EngineConfig, option_groups, option_names
from minisgl.extension_loader import load_extensions

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
OPTIONS = (DOCS / "options.md").read_text()


def _flags(kind: type) -> list[str]:
    """Every flag of a dataclass of options: its own and its aliases."""
    flags = []
    for f in dataclasses.fields(kind):
        if not f.metadata.get("internal"):
            flags += ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
    return flags


def _missing(names: list[str]) -> list[str]:
    return [n for n in names if f"`{n}`" not in OPTIONS and f"`{n} " not in OPTIONS]


def test_readme_is_short_and_keeps_the_ci_test_command() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 200
    # .ci/run runs the README's test command; the two must not drift apart.
    assert "python -m pytest" in text
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_readme_figures_are_in_results() -> None:
    """Every number in the README's figures table appears in benchmark/RESULTS.md."""
    results = (ROOT / "benchmark" / "RESULTS.md").read_text()
    section = README.read_text().split("## Performance", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 2, "no figures table under '## Performance'"
    for row in rows[1:]:  # the first is the header
        figure = row.strip("|").split("|")[1]
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", figure):
            assert number in results, f"README figure {number} ({figure.strip()}) not in RESULTS.md"


def test_every_engine_option_is_documented() -> None:
    assert _missing(_flags(EngineConfig)) == []
    assert _missing(option_names(EngineConfig)) == []  # the LLM keywords


def test_every_extension_option_is_documented() -> None:
    groups = option_groups()
    assert groups, "no extension registered an option group"
    for group in groups:
        assert _missing(_flags(group.options)) == [], group.title
        if not group.server:
            assert _missing(option_names(group.options)) == [], group.title


def test_every_command_line_flag_is_documented() -> None:
    """Server and shell flags too: everything `python -m minisgl --help` lists."""
    flags = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")]
    assert _missing([f for f in flags if f != "--help"]) == []


def test_every_environment_switch_is_documented() -> None:
    load_extensions()  # extensions declare switches of their own
    names = [s.env_name for s in env.registered()]
    assert "MINISGL_INT4_GEMV" in names  # an extension's switch is among them
    assert _missing(names) == []


def test_every_extension_is_in_the_architecture() -> None:
    text = (DOCS / "architecture.md").read_text()
    packages = [m.name for m in pkgutil.iter_modules(minisgl.extensions.__path__) if m.ispkg]
    assert packages
    assert [p for p in packages if f"`{p}`" not in text] == []


def test_module_paths_in_docs_exist() -> None:
    pages = sorted(DOCS.glob("*.md")) + [README]
    named = 0
    for page in pages:
        for path in re.findall(r"minisgl/[\w/]*\w\.py|minisgl/[\w/]*\w/", page.read_text()):
            named += 1
            assert (ROOT / path).exists(), f"{page.name} names {path}, which does not exist"
    assert named > 20
