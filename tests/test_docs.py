"""Every code block of README.md and docs/ runs (see ``tests/docs_runner.py``), so none can rot.

The files run as processes of their own, up to :data:`PARALLEL` at once:
they spend most of their time waiting for the mesh.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT, subprocess_env
from tests.docs_runner import DOCS, LANGUAGES, SKIPPED, parse, rel, shell_lines

PARALLEL = 4
RUNNABLE = [path for path in DOCS if any(not block.skip for block in parse(path).blocks)]
FILE_TIMEOUT = 170.0


def _run(path: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    work = tmp / rel(path).replace("/", "_")
    work.mkdir()
    try:
        return subprocess.run(
            [sys.executable, "-m", "tests.docs_runner", str(path), str(work)],
            cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=FILE_TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, -1, str(exc.stdout or ""), f"timed out after {FILE_TIMEOUT} s")


@pytest.fixture(scope="module")
def doc_runs(request: pytest.FixtureRequest) -> Iterator[dict[Path, Future[subprocess.CompletedProcess[str]]]]:
    """The run of every file selected for this session, all started at once (PARALLEL at a time)."""
    selected = [
        item.callspec.params["path"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_code_blocks_run" and hasattr(item, "callspec")
    ]
    with tempfile.TemporaryDirectory(prefix="dafka-docs-") as tmp, ThreadPoolExecutor(PARALLEL) as pool:
        yield {path: pool.submit(_run, path, Path(tmp)) for path in selected}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", RUNNABLE, ids=rel)
def test_code_blocks_run(path: Path, doc_runs: dict[Path, Future[subprocess.CompletedProcess[str]]]) -> None:
    out = doc_runs[path].result()
    if out.returncode == SKIPPED:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 0, f"{rel(path)}:\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"


def test_every_block_is_run_or_says_why_not() -> None:
    for path in DOCS:
        for block in parse(path).blocks:
            where = f"{rel(path)}:{block.line}"
            assert block.lang in LANGUAGES, f"{where}: fence language {block.lang!r}, expected one of {LANGUAGES}"
            assert block.skip != "(no reason given)", f"{where}: a skipped block says why"


def test_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert "make run" in text and "make test" in text
    for link in re.findall(r"\]\(([^)#]+)[^)]*\)", text):
        if not re.match(r"[a-z]+://", link):
            assert (ROOT / link).exists(), f"README links to {link}, which is not in the repository"


def test_docs_link_nothing_outside_the_repository() -> None:
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        # The development machine's checkout path, spelled so that this file does not name it.
        assert "../shared" not in text and "/".join(("", "work", "")) not in text, rel(path)


def test_shell_lines_join_continuations() -> None:
    assert shell_lines("# c\na \\\n  b\n\nc &\n") == ["a b", "c &"]
