"""The README and docs/ stay true: the README is a front page, CI runs its two commands verbatim, and every
``nkv ...`` command the docs show parses with today's CLI (parsed, not run)."""

import re
import shlex
from pathlib import Path

import pytest
import typer

from flows.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")


def marked_block(text: str, marker: str) -> list[str]:
    """The lines of the fenced block right after ``<!-- marker -->``."""
    lines = text.splitlines()
    at = lines.index(f"<!-- {marker} -->")
    assert FENCE.match(lines[at + 1]), f"no code block after <!-- {marker} -->"
    end = next(i for i in range(at + 2, len(lines)) if FENCE.match(lines[i]))
    return [line.strip() for line in lines[at + 2 : end] if line.strip()]


def test_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 250


def test_ci_runs_the_readme_commands_verbatim():
    """.ci/run's first step runs each line of the README's two commands as written, the install before the
    tests; its second step (the extras) comes after."""
    text = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    step2 = next(i for i, line in enumerate(ci) if line.startswith('echo "== step 2'))
    where = []
    for marker in ("main-job", "tests"):
        block = marked_block(text, marker)
        assert block, marker
        for line in block:
            hits = [i for i, c in enumerate(ci[:step2]) if line in c and not c.lstrip().startswith("#")]
            assert hits, f"README's {marker} line is not in .ci/run's first step: {line}"
            where.append(hits[0])
    assert where == sorted(where), "the README's commands run in another order in .ci/run"
    assert "pip install -e \".[test]\"" in marked_block(text, "main-job")[0]


def doc_commands(path: Path) -> list[tuple[str, int, str]]:
    """``(file, line number, command)`` for each ``nkv ...`` line of a code block (backslash continuations
    joined)."""
    found, block, pending = [], False, None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            block = not block
            continue
        if block:
            text = line.strip()
            if pending is not None:
                pending = (pending[0], pending[1] + " " + text.rstrip("\\"))
                if not text.endswith("\\"):
                    found.append((path.name, *pending))
                    pending = None
            elif text.startswith("nkv "):
                if text.endswith("\\"):
                    pending = (n, text.rstrip("\\"))
                else:
                    found.append((path.name, n, text))
    return found


COMMANDS = [c for p in DOCS for c in doc_commands(p)]


def parse(argv: list[str]) -> None:
    """What the CLI does with ``argv`` up to calling the command: every option and value checked."""
    group = typer.main.get_command(app)
    argv = [a for a in argv if a != "--verbose"]  # the one global option
    if argv[0].startswith("-"):  # nkv --help
        group.make_context("nkv", argv)
        return
    root = group.make_context("nkv", [], resilient_parsing=True)
    command = group.get_command(root, argv[0])
    assert command is not None, f"no command {argv[0]!r}"
    with root:
        command.make_context(argv[0], argv[1:], parent=root)


def is_usage_error(exc: BaseException) -> bool:
    """click's UsageError, or the one of the click copy that newer typer releases carry."""
    return any(c.__name__ == "UsageError" for c in type(exc).__mro__)


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 40  # the scan finds them (a broken scan would pass every command below)


@pytest.mark.parametrize("where, line, command", COMMANDS, ids=[f"{f}:{n}" for f, n, _ in COMMANDS])
def test_every_documented_command_parses(where, line, command):
    argv = shlex.split(command, comments=True)[1:]
    try:
        parse(argv)
    except typer.Exit:  # --help
        pass
    except Exception as exc:
        if not is_usage_error(exc):
            raise
        pytest.fail(f"{where}:{line}: {command}\n{exc.format_message()}")


def test_a_wrong_option_is_caught():
    for argv in (["run", "--no-such-option", "1"], ["run", "--max-new-tokens", "many"]):
        with pytest.raises(Exception) as caught:
            parse(argv)
        assert is_usage_error(caught.value), repr(caught.value)
    with pytest.raises(AssertionError, match="no command"):
        parse(["no-such-command"])


def test_readme_press_table_names_every_registered_press_in_order():
    from nestedkv.press import PRESSES

    text = (ROOT / "README.md").read_text()
    table = text[text.index("| press | paper | what it keeps |"):].split("\n\n")[0].splitlines()[2:]
    assert [row.split("`")[1] for row in table] == list(PRESSES)


def test_every_registered_press_is_exported_by_name():
    import nestedkv
    import nestedkv.press as press_module
    from nestedkv.press import PRESSES

    for cls in PRESSES.values():
        assert getattr(nestedkv, cls.__name__) is cls is getattr(press_module, cls.__name__)
        assert cls.__name__ in press_module.__all__


def test_the_code_points_at_docs_and_sections_that_exist():
    """Comments and messages that send a reader to a page (``docs/x.md``, or ``docs/x.md, "Section"``) name a
    page that exists and, when they name one, a section of it; none points at a README section (they moved)."""
    cited = re.compile(r"""(docs/[\w.-]+\.md)(?:, ["']([^"']+)["'])?""")
    found = 0
    for folder in ("flows", "bench", "pipeline", "nestedkv"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            assert not re.search(r"\(README[,:]|\(see the README", text), path
            for page, section in cited.findall(text):
                found += 1
                assert (ROOT / page).is_file(), (path, page)
                if section:
                    headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(encoding="utf-8"), re.M)
                    assert section in headings, (path, page, section)
    assert found


def test_flows_page_names_every_flat_parameter_of_the_batch_flows():
    import inspect

    from flows.batch import qa_batch, summarize_batch

    text = (ROOT / "docs/flows.md").read_text(encoding="utf-8")
    listed = re.search(r"Flat parameters \(([^)]*)\)", text).group(1)
    for flow in (summarize_batch, qa_batch):
        flat = [p for p in inspect.signature(flow.fn).parameters if p not in ("options", "hooks")]
        assert re.findall(r"`(\w+)`", listed) == flat
