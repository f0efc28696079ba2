"""Every code block in README.md and docs/*.md runs, or says why it does not.

- ```python blocks run in order, one namespace per page (a block may use what earlier blocks of its page
  defined), in a fresh temporary folder per page.
- ```bash / ```sh blocks run when they hold only `dpkit ...` commands: each command goes through
  `dpkit.cli.main.main(argv)` in the same process (importing torch once for all pages keeps the whole
  test within seconds) and must return 0.
- A python, bash or sh block that should not run (it needs GPUs, several machines, a launcher, or is a
  fragment) is preceded by `<!-- not-run: why -->`; the reason may not be empty.
- ```console, ```text, ```json and ```jsonc blocks are output or formats, never run. Every fence names its
  language, so no command hides in an unlabelled block.

Pages are found by glob, so pages added later are covered without touching this file. One subprocess
runs every page (this file, executed as a script) and writes a result per page as it goes, so a page
that hangs fails alone with the pages after it, at the timeout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGUAGES = ("python", "bash", "sh")
OUTPUT_LANGUAGES = ("console", "text", "json", "jsonc")
NOT_RUN = re.compile(r"^<!--\s*not-run:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)```(.*)$")
# pages other issues add; linked from the README before they land (the lead merges the branches)
PENDING_PAGES: set[str] = set()
RUN_TIMEOUT_SECONDS = 300
README_MAX_BYTES = 8000


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    not_run: str | None  # the reason, when marked not-run

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """The fenced blocks of a markdown page, with the not-run reason written right before each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.group(1), opening.group(2).strip()
        start, body, i = i, [], i + 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{page}:{start + 1}: code block is never closed")
        previous = start - 1
        while previous >= 0 and not lines[previous].strip():
            previous -= 1
        marker = NOT_RUN.match(lines[previous].strip()) if previous >= 0 else None
        blocks.append(
            Block(page, start + 1, language, "\n".join(body) + "\n", marker.group(1).strip() if marker else None)
        )
        i += 1
    return blocks


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append(argv)
    return commands


# --- the runner: `python tests/test_docs.py RESULTS.json PAGE...` -------------------------------------
def run_page(page: Path, workdir: Path) -> None:
    """Run a page's blocks in order in `workdir`; raise on the first failure, naming the block."""
    from dpkit.cli.main import main as dpkit_main

    namespace: dict = {"__name__": "__docs__"}
    old_cwd = os.getcwd()
    os.chdir(workdir)
    try:
        for block in code_blocks(page):
            if block.not_run is not None or block.language not in RUN_LANGUAGES:
                continue
            try:
                if block.language == "python":
                    exec(compile(block.code, block.where, "exec"), namespace)
                    continue
                for argv in shell_commands(block.code):
                    try:
                        code = dpkit_main(argv[1:])
                    except SystemExit as exit_:  # --help and argparse errors exit
                        code = exit_.code or 0
                    if code != 0:
                        raise RuntimeError(f"`{shlex.join(argv)}` returned {code}")
            except BaseException as error:
                raise RuntimeError(f"block at {block.where} failed: {type(error).__name__}: {error}") from error
    finally:
        os.chdir(old_cwd)


def run_pages(results_path: Path, pages: list[Path]) -> None:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dpkit-docs-") as scratch:
        for k, page in enumerate(pages):
            workdir = Path(scratch) / f"page{k}"
            workdir.mkdir()
            started, started_cpu = time.perf_counter(), time.process_time()
            output = io.StringIO()
            try:
                with contextlib.redirect_stdout(output):
                    run_page(page, workdir)
                result = {"ok": True}
            except BaseException:
                result = {"ok": False, "error": traceback.format_exc()}
            result.update(
                seconds=round(time.perf_counter() - started, 2),
                cpu_seconds=round(time.process_time() - started_cpu, 2),
                output=output.getvalue()[-4000:],
            )
            results[str(page)] = result
            results_path.write_text(json.dumps(results))  # as we go: a later hang keeps these


# --- the tests ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def page_results(tmp_path_factory) -> tuple[dict, str]:
    results_path = tmp_path_factory.mktemp("docs") / "results.json"
    try:
        done = subprocess.run(
            [sys.executable, __file__, str(results_path), *map(str, PAGES)],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_SECONDS,
            env={**os.environ, "TQDM_DISABLE": "1"},
        )
        log = done.stdout[-3000:] + done.stderr[-3000:]
    except subprocess.TimeoutExpired:
        log = f"the docs runner passed its {RUN_TIMEOUT_SECONDS} s timeout"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    return results, log


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page: Path, page_results: tuple[dict, str]) -> None:
    results, log = page_results
    result = results.get(str(page))
    assert result is not None, f"{page.relative_to(ROOT)} did not run; runner log:\n{log}"
    assert result["ok"], f"{result['error']}\n--- output ---\n{result['output']}"


def block_problems(page: Path) -> list[str]:
    """What is wrong with a page's fences: unknown languages, empty reasons, commands the test cannot run."""
    problems = []
    known = RUN_LANGUAGES + OUTPUT_LANGUAGES
    for block in code_blocks(page):
        if block.language not in known:
            problems.append(f"{block.where}: fence language {block.language!r}; use one of {', '.join(known)}")
        elif block.not_run is not None:
            if block.language not in RUN_LANGUAGES:
                problems.append(f"{block.where}: a not-run marker on a {block.language} block, which never runs")
            elif not block.not_run:
                problems.append(f"{block.where}: <!-- not-run: --> needs a reason")
        elif block.language in ("bash", "sh"):
            commands = shell_commands(block.code)
            if not commands:
                problems.append(f"{block.where}: an empty {block.language} block")
            problems += [
                f"{block.where}: `{shlex.join(argv)}` is not a dpkit command, so the test cannot run it; "
                "mark the block <!-- not-run: why --> or show it as ```console"
                for argv in commands
                if argv[0] != "dpkit"
            ]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_is_run_or_says_why_not(page: Path) -> None:
    problems = block_problems(page)
    assert not problems, "\n".join(problems)


FAULTY_PAGE = """# A page with every kind of fence

```
dpkit train --steps 2
```

```bash
make demo
```

<!-- not-run: -->
```python
import nowhere
```

<!-- not-run: needs GPUs -->
```bash
dpkit train --accelerator cuda
```

<!-- not-run: output -->
```console
$ dpkit --help
```

```bash
dpkit --help  # runs
```
"""


def test_the_checker_names_each_unmarked_or_unlabelled_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(FAULTY_PAGE)
    blocks = code_blocks(page)
    assert [(b.line, b.language, b.not_run) for b in blocks] == [
        (3, "", None),
        (7, "bash", None),
        (12, "python", ""),
        (17, "bash", "needs GPUs"),
        (22, "console", "output"),
        (26, "bash", None),
    ]
    problems = block_problems(page)
    assert [problem.split(": ")[0] for problem in problems] == [f"{page}:{line}" for line in (3, 7, 12, 22)]
    assert "`make demo` is not a dpkit command" in problems[1]


def test_the_runner_names_the_failing_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nvalue = 1\n```\n\n```python\nassert value == 2, 'wrong'\n```\n")
    with pytest.raises(RuntimeError, match=r"page.md:5 failed: AssertionError: wrong"):
        run_page(page, tmp_path)
    page.write_text("```python\nvalue = 2\n```\n\n```bash\ndpkit train --steps 0\n```\n")
    with pytest.raises(RuntimeError, match=r"`dpkit train --steps 0` returned 2"):
        run_page(page, tmp_path)


def test_pages_exist_and_blocks_are_parsed() -> None:
    assert (ROOT / "docs").is_dir() and len(PAGES) > 1
    runnable = [b for page in PAGES for b in code_blocks(page) if b.language in RUN_LANGUAGES and b.not_run is None]
    assert any(b.language == "python" for b in runnable) and any(b.language == "bash" for b in runnable)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)  # no headings in code
    headings = re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        relative = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if not path.exists():
            assert relative in PENDING_PAGES, f"{page.relative_to(ROOT)}: link to {target} finds nothing"
            continue
        if anchor and path.suffix == ".md":
            assert anchor in heading_anchors(path), (
                f"{page.relative_to(ROOT)}: link to {target}: no such heading in {relative}"
            )


def test_readme_is_a_front_page() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move reference material into docs/"
    linked = {target.partition("#")[0] for target in LINK.findall((ROOT / "README.md").read_text(encoding="utf-8"))}
    unlinked = [
        page.relative_to(ROOT).as_posix() for page in PAGES[1:] if page.relative_to(ROOT).as_posix() not in linked
    ]
    assert not unlinked, f"README.md does not link {', '.join(unlinked)}; add them under 'More'"


if __name__ == "__main__":
    run_pages(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
