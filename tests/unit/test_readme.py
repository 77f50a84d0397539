"""README.md is a landing page: small, its two commands are the ones CI and the scripts run, and
every relative link in it and in docs/*.md reaches a file (and heading) that exists."""

from __future__ import annotations

import pathlib
import re
import shlex

REPO = pathlib.Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))

# Pages that hold what left the README; each must be linked from it.
MOVED_PAGES = [
    "architecture.md",
    "benchmarks.md",
    "compatibility.md",
    "console.md",
    "deployment.md",
    "development.md",
    "grpc-api.md",
    "multi-tenancy.md",
    "openai.md",
    "security.md",
]

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no section '## {title}'"
    return match.group(1)


def _commands(block: str) -> list[list[str]]:
    """The command lines of a shell block, comments dropped, as argv lists."""
    return [shlex.split(line, comments=True) for line in block.splitlines() if shlex.split(line, comments=True)]


def _readme_commands() -> list[list[str]]:
    section = _section(README.read_text(), "The two commands (fresh machine)")
    blocks = [body for lang, body in _FENCE.findall(section) if lang in ("bash", "sh")]
    assert len(blocks) == 2, "the two commands are two fenced bash blocks"
    commands = [_commands(b) for b in blocks]
    assert all(len(c) == 1 for c in commands), commands
    return [c[0] for c in commands]


def _ci_commands() -> list[list[str]]:
    lines = _commands((REPO / ".ci" / "run").read_text())
    return [c for c in lines if c[0] not in ("set", "cd")]


def test_readme_is_small():
    assert README.stat().st_size <= 15 * 1024, f"README.md is {README.stat().st_size} bytes (limit 15 KB)"


def test_readme_test_command_is_what_ci_runs():
    test_command = _readme_commands()[1]
    assert test_command == ["bash", "scripts/test.sh"]
    assert _ci_commands() == [test_command], ".ci/run must run exactly the README's test command"


def test_readme_commands_and_setup_exist():
    for argv in _readme_commands():
        assert argv[0] == "bash" and (REPO / argv[1]).is_file(), argv
        # The README says setup.sh is called by both.
        assert "bash scripts/setup.sh" in (REPO / argv[1]).read_text(), f"{argv[1]} does not run scripts/setup.sh"
    assert (REPO / "scripts" / "setup.sh").is_file()
    assert "scripts/setup.sh" in README.read_text()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: pathlib.Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return _LINK.findall(text)


def _broken_links(path: pathlib.Path) -> list[str]:
    broken = []
    for link in _links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):
            continue  # http:, https:, mailto:
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{link} (no heading #{anchor} in {file.relative_to(REPO)})")
    return broken


def test_relative_links_resolve():
    assert DOCS
    broken = {str(p.relative_to(REPO)): _broken_links(p) for p in [README, *DOCS]}
    broken = {page: links for page, links in broken.items() if links}
    assert not broken, broken


def test_moved_pages_exist_and_are_linked_from_readme():
    linked = {link.partition("#")[0] for link in _links(README)}
    for page in MOVED_PAGES:
        assert (REPO / "docs" / page).is_file(), page
        assert f"docs/{page}" in linked, f"README.md does not link docs/{page}"


def test_slug_matches_github():
    assert _slug("Latest run — 2026-11-23 23:51 UTC") == "latest-run--2026-11-23-2351-utc"
    assert _slug("`service Trainer` (`trainer.proto`)") == "service-trainer-trainerproto"
    assert _slug("The two commands (fresh machine)") == "the-two-commands-fresh-machine"
