"""The documentation against itself and the code: the README stays a landing page, every relative link and
#anchor of the README and docs/ resolves (GitHub's anchors), every page is on the README's map and in the
site, the knob tables match the configuration, the table of rooms names every file of the package, and the
site builds with mkdocs --strict."""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from milestream.config import Config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
MAP_ROW = re.compile(r"^\| \[[^\]]+\]\(docs/([\w-]+\.md)\) \|", re.M)  # the README's map of docs/


def prose(text: str) -> str:
    """The text a reader follows links in: fenced blocks and code spans left out."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, every character but letters, digits,
    spaces, hyphens and underscores dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@functools.cache
def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading's get -1, -2, ... as on GitHub."""
    found: set[str] = set()
    repeats: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = github_anchor(heading)
        found.add(f"{slug}-{repeats[slug]}" if slug in repeats else slug)
        repeats[slug] = repeats.get(slug, 0) + 1
    return found


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    return [f"{page.relative_to(ROOT)}: {b}" for b in broken]


def test_the_readme_is_a_landing_page():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"
    assert README.read_text().split("\n")[2:6] == [
        "```", "./scripts/setup && .venv/bin/milestream run --run-dir runs/demo", "./scripts/test", "```"]


def test_github_anchors():
    assert github_anchor("The live page, TensorBoard, W&B and MLflow") == "the-live-page-tensorboard-wb-and-mlflow"
    assert github_anchor("Comparison settings (`match`)") == "comparison-settings-match"
    assert github_anchor("The rollout–train mismatch") == "the-rollouttrain-mismatch"


def test_every_relative_link_and_anchor_resolves():
    broken = [b for page in PAGES for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_readme_links_into_docs_are_relative_file_links():
    absolute = [t for t in LINK.findall(prose(README.read_text())) if re.match(r"(https?:|/)", t) and "docs/" in t]
    assert not absolute


def test_every_page_is_on_the_readme_map_the_docs_home_and_the_site():
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    on_map = MAP_ROW.findall(README.read_text())
    on_home = [t for t in relative_links(DOCS / "index.md") if t.endswith(".md")]
    assert set(on_map) == pages, f"README's map lacks {pages - set(on_map)}, names missing {set(on_map) - pages}"
    assert on_home == on_map, "docs/index.md lists the pages of the README's map, in its order"
    assert yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"] == ["index.md", *on_map]


def default_cell(value: object) -> str:
    if value is None:
        return "—"
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, tuple):
        value = list(value)
    return "`" + (value if isinstance(value, str) and value else json.dumps(value)) + "`"


def test_the_configuration_reference_lists_every_knob_with_its_default():
    rows = dict(re.findall(r"^\| `([a-z_]+\.[a-z_]+)` \| (.+?) \|$", (DOCS / "configuration.md").read_text(), re.M))
    config = Config()
    expected = {f"{name}.{key}": default_cell(getattr(getattr(config, name), key))
                for name in Config.model_fields for key in type(getattr(config, name)).model_fields}
    assert rows == expected
    assert rows["run.run_dir"] == "`runs/latest`"


def test_the_table_of_rooms_names_every_file_of_the_package():
    text = (DOCS / "architecture.md").read_text()
    rooms = text[text.index("## Rooms"):text.index("\n## ", text.index("## Rooms") + 1)]
    files = {p.name for p in (ROOT / "milestream").rglob("*") if p.is_file() and p.name != "__init__.py"
             and "__pycache__" not in p.parts and p.suffix in {".py", ".html", ".yml"}}
    unnamed = sorted(name for name in files if f"`{name}`" not in rooms)
    assert not unnamed, f"docs/architecture.md's table of rooms does not name {unnamed}"


def test_the_readme_sketch_is_the_architecture_sketch():
    def sketch(page: Path) -> str:
        return next(m.group(0) for m in FENCE.finditer(page.read_text()) if "stream processor" in m.group(0))
    assert sketch(README) == sketch(DOCS / "architecture.md")


def test_the_site_builds_strictly(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                            str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
