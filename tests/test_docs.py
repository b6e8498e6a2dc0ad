"""The README and docs/: the commands they give are the ones that run, their links resolve, and the
README's notebook quick start runs and shows what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_is_an_entry_point():
    assert len(README.read_text().splitlines()) <= 200


def test_readme_test_command_is_what_ci_runs():
    commands = [b.strip() for b in _blocks(README.read_text(), "bash")]
    assert len(commands) == 2
    main_job, tests = commands
    assert main_job.endswith("&& sinklens analyze")
    assert tests.endswith("&& pytest -n logical")
    ci_steps = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci_steps[-1] == tests  # CI runs exactly the README's command
    # the two set-ups differ only in the test extra and what they run
    assert main_job.replace("-e .", '-e ".[test]"').rsplit("&&", 1)[0] == tests.rsplit("&&", 1)[0]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif anchor and anchor not in _anchors(target):
            broken.append(link)
    assert broken == []


@pytest.mark.slow
def test_readme_quick_start_runs(smollm2, monkeypatch):
    import sinklens

    (code,) = _blocks(README.read_text(), "python")
    assert len(code.strip().splitlines()) <= 14
    monkeypatch.setattr(sinklens, "load_model", lambda *a, **k: smollm2)  # loaded once per session
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, str(README), "exec"), scope)
    assert "Massive dimensions at position 0: [507" in out.getvalue()  # the printed summary
    path = scope["report"].neurons.path(507)
    assert path.write_layer == 11 and path.peak_value > 10_000
    # the self-only mask turned token 5 into a sink beside the BOS, as the comment says
    assert scope["sinks"].sink_positions == [0, 5]
    assert scope["logits"].shape[:2] == scope["tokens"].shape
