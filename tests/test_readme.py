"""README stays true: its set-up and test commands are the ones CI runs and they work; it stays a
short front door whose links resolve, whose commands exist and whose example output is current."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", flags=re.S | re.M)
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^)\s]+)\)")  # [text, maybe [nested]](target)


def _blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_setup_is_two_commands_and_tests_one():
    setup, tests = _blocks()[:2]
    setup_cmds = [line.split("#")[0].strip() for line in setup.splitlines() if line.strip()]
    assert len(setup_cmds) == 2
    assert setup_cmds[0].startswith("pip install") and '-e ".[dev]"' in setup_cmds[0]
    assert setup_cmds[1].startswith("ampaudit check fixtures/")
    assert tests.strip() == "python -m pytest -q"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = _blocks()[1].strip()
    assert test_cmd in ci.splitlines()
    assert 'pip install --quiet --disable-pip-version-check "torch==2.13.0"' in ci


def test_main_job_runs_clean(cli):
    main_job = _blocks()[0].splitlines()[1].split("#")[0].split()
    assert main_job[0] == "ampaudit"
    result = cli(*main_job[1:])
    assert result.code == 0
    assert "No findings." in result.out


# --- the front door and the pages behind it ---------------------------------------------------


def test_readme_is_short():
    assert len(README.splitlines()) < 200


def _prose(text: str) -> str:
    """The text with fenced code blocks blanked out (their lines kept, so line numbers hold)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower-case, punctuation dropped, spaces to hyphens, -1, -2 for repeats."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", _prose(path.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    links = LINK.findall(_prose(page.read_text()))
    broken = []
    for target in links:
        if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_readme_links_every_docs_page():
    linked = {target.partition("#")[0] for target in LINK.findall(README)}
    for page in ("check", "convert", "watch", "rules", "benchmarks", "design"):
        assert f"docs/{page}.md" in linked


def _commands(text: str) -> list[list[str]]:
    """Every `ampaudit ...` command line in the text: lines of ```bash blocks, `$ ampaudit` lines
    of other blocks, and inline code spans (only the subcommand of those)."""
    commands = []
    for lang, body in FENCE.findall(text):
        for line in body.splitlines():
            line = line.split(" #")[0].strip()
            if lang != "bash":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if line.startswith("ampaudit "):
                commands.append(line.split())
    for span in re.findall(r"`ampaudit\s+([\w-]+)", _prose(text)):
        commands.append(["ampaudit", span])
    return commands


def _help(cli, capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli(*args, "--help")
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_every_command_in_the_docs_is_real(cli, capsys):
    top = _help(cli, capsys)
    # argparse lists the subcommands under COMMAND, indented by four spaces.
    subcommands = set(re.findall(r"^ {4}([a-z][\w-]*)(?:\s|$)", top, flags=re.M))
    assert {"check", "convert", "run", "report", "rules", "explain", "ops"} <= subcommands

    for page in MARKDOWN:
        used = {cmd[1] for cmd in _commands(page.read_text())}
        assert used <= subcommands, f"{page.relative_to(ROOT)}: not subcommands: {used - subcommands}"

    examples = [cmd for cmd in _commands(README) if len(cmd) > 2]
    # One example each for check, convert and run, and every option they use exists.
    assert {"check", "convert", "run"} <= {cmd[1] for cmd in examples}
    for cmd in examples:
        sub_help = _help(cli, capsys, cmd[1])
        if cmd[1] == "run":  # options after the script belong to the script
            cmd = cmd[: next(i for i, arg in enumerate(cmd) if arg.endswith(".py")) + 1]
        for option in (arg.split("=")[0] for arg in cmd[2:] if arg.startswith("-")):
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", sub_help), f"{' '.join(cmd)}: {option}?"


def _panel_rows(block: str) -> list[str]:
    """`key value` rows of a rich panel in a README example, with the box and padding dropped."""
    rows = []
    for line in block.splitlines():
        if line.startswith("│") and "..." not in line:
            rows.append(" ".join(line.strip("│ ").split()))
    return rows


@pytest.mark.parametrize("subcommand", ["check", "convert"])
def test_readme_example_output_is_current(cli, monkeypatch, tmp_path, subcommand):
    monkeypatch.setenv("COLUMNS", "110")
    (example,) = [body for _, body in FENCE.findall(README) if body.startswith(f"$ ampaudit {subcommand} ")]
    command = example.splitlines()[0][2:].split()
    if "-o" in command:  # write the conversion somewhere harmless
        out = command[command.index("-o") + 1]
        example = example.replace(out, str(tmp_path / "out"))
        command[command.index("-o") + 1] = str(tmp_path / "out")
    result = cli(*command[1:])
    assert result.code == 0, result.err
    printed = " ".join(result.out.split())
    rows = [row for row in _panel_rows(example) if str(tmp_path) not in row and row != ""]
    assert len(rows) >= 5
    for row in rows:
        assert row in printed, f"README's `ampaudit {subcommand}` example is stale: {row!r}"


def test_the_pre_commit_snippet_names_the_lint_only_hook():
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with pre-commit (the dev extra)")
    (snippet,) = [body for lang, body in FENCE.findall(README) if lang == "yaml" and "pre-commit" in body]
    (repo,) = yaml.safe_load(snippet)["repos"]
    hooks = {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    assert [h["id"] for h in repo["hooks"]] == ["ampaudit"]
    assert hooks["ampaudit"]["entry"] == "ampaudit check --lint-only"
    assert hooks["ampaudit"]["language"] == "python"
    # the hook installs `pip install ampaudit`: the lint alone; the rest is one extra away
    assert 'pip install "ampaudit[torch]"' in README
