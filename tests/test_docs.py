"""The documentation agrees with the code: docs/configuration.md holds every row
of kvd.config.SETTINGS as the code has it, every relative link in README.md and
docs/*.md reaches a file, and the errors the guide says to catch are exported.

Each check fails -- never passes -- when it finds nothing to check.
"""

from __future__ import annotations

import re
from pathlib import Path

import kvd_client
from kvd.config import SETTINGS
from kvd.protocol import errors as E

from support import REPO

DOCS = REPO / "docs"


def cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def expected_row(s) -> str:
    """The row docs/configuration.md must hold for setting `s` (copy it from a failure)."""
    return f"| `{s.name}` | {cell(s.describe_default())} | `{s.env}` | `{s.flag}` | {cell(s.doc)} |"


def test_the_configuration_page_holds_every_setting_as_the_code_has_it():
    lines = (DOCS / "configuration.md").read_text().splitlines()
    rows = {m.group(1): line for line in lines if (m := re.match(r"^\| `(\w+)` \|", line))}
    assert len(rows) >= len(SETTINGS) > 20, f"found {len(rows)} setting rows in docs/configuration.md"
    wrong = []
    for s in SETTINGS:
        if rows.get(s.name) != expected_row(s):
            wrong.append(f"docs/configuration.md: {s.name} should read\n{expected_row(s)}\nnot\n{rows.get(s.name)}")
    extra = set(rows) - {s.name for s in SETTINGS}
    assert not wrong, "\n\n".join(wrong)
    assert not extra, f"docs/configuration.md documents settings the code does not have: {sorted(extra)}"


def pages() -> list[Path]:
    found = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    assert len(found) >= 10, found
    return found


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_reaches_a_file():
    checked, broken = 0, []
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            checked += 1
            path = target.split("#")[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert checked > 30, f"only {checked} relative links found"
    assert not broken, "\n".join(broken)


def test_every_page_is_in_the_index_and_linked_from_the_readme():
    index = (DOCS / "README.md").read_text()
    readme = (REPO / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"
            assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_what_the_guide_says_to_catch_is_exported():
    # The guide's failure section names the errors a strict client catches,
    # each as `kvd_client.Name`.
    text = (DOCS / "guide.md").read_text()
    named = set(re.findall(r"`kvd_client\.([A-Z]\w+)`", text))
    assert len(named) >= 8, f"the guide names only {sorted(named)}"
    for name in named:
        assert name in kvd_client.__all__, f"the guide says to catch kvd_client.{name}, which is not exported"
        obj = getattr(kvd_client, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, E.KvdError), name
