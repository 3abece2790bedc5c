"""Every relative link in README.md and docs/ resolves inside the repository (the file, and the
heading an anchor names)."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def pages():
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md",
            *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading):
    """The anchor GitHub (and the docs site, MyST) gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page):
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def broken_links(page, root=ROOT):
    """The links of ``page`` that do not resolve inside ``root``, with why."""
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):            # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if root.resolve() not in (dest, *dest.parents):
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor")
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    assert broken_links(page) == []


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "a.md").write_text("# Top heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](a.md#top-heading) [gone](missing.md) [out](../../x.md) "
                    "[anchor](a.md#nowhere) [web](https://example.org)\n"
                    "```\n[in a code block](ignored.md)\n```\n")
    assert [b.split(":")[0] for b in broken_links(page, tmp_path)] == [
        "missing.md", "../../x.md", "a.md#nowhere"]


def test_nothing_refers_to_files_outside_the_repository():
    here = pathlib.Path(__file__).resolve()
    files = [p for ext in ("py", "md", "ipynb", "toml", "yml") for p in ROOT.rglob(f"*.{ext}")
             if ".git" not in p.parts and p.resolve() != here]
    assert files
    for path in files:
        assert "../shared" not in path.read_text(errors="replace"), path
