"""Run the code blocks of one Markdown file (README.md, docs/): ``tests/test_docs.py`` uses it.

    python -m tests.docs_runner FILE WORKDIR      (exit 0: all ran, 1: a block failed, 3: skipped)

Every code block of README.md and docs/ runs, so none can rot.

Our own small collector (about the size of a plugin's configuration): the
plugins that run Markdown fences (pytest-markdown-docs, pytest-examples) run
Python only, and Sybil would need a custom shell evaluator and a conftest at
the repository root; our shell blocks need a mesh, services started with
``&`` and per-document state, which is what this file does.

One test per Markdown file, each file in a process of its own (several at
once: most of the time goes to waiting for the mesh).  Its blocks run in order, in a sandbox (a fresh
temporary directory as the working directory) with a configuration file
(``$DAFKA_CONFIG``) that puts the tower, the Tank port and the Kafka port on
free ports, so the documents' standard ports (5556, 5557, 11011, 9092) are
mapped to those wherever a block names them.  The fences:

- ``python``: executed in-process, in one namespace per document (a block
  may use what an earlier block of the same document defined).
- ``sh``: line by line (``\\`` continues a line) with ``sh -c``, the venv's
  ``bin`` first on ``PATH``; every line must exit 0.  A line ending in ``&``
  is a service, ready once it printed its first line, stopped at the end;
  ``kill %N`` stops the document's N-th service; ``export K=V`` sets a
  variable; ``source .venv/bin/activate`` is a no-op (the ``PATH`` already
  holds the venv).
- ``toml``: parsed and checked against :data:`dafka.config.SCHEMA`.
- ``text``: sample output, not code.

What a document leaves in its working directory must be ignored by the
repository's ``.gitignore`` (``var/``): a reader runs the tutorials in the
repository, and their keys, databases and outboxes must not land in a commit.

Directives (HTML comments, invisible on the page):

- ``<!-- docs-test: mesh -->`` anywhere in a file: ``dafka up --data var``
  (what ``make run`` starts) runs in the sandbox before the first block.
- ``<!-- docs-test: skip REASON -->`` right before a fence: the block is not
  run, for the reason given (systemd, several hosts, ``make`` itself...).
- ``<!-- walkthrough: NAME -->`` right before a fence: run by
  ``tests/test_multihost.py`` on three network namespaces, not here.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dafka.config import check_settings
from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"python", "sh", "toml", "text"}
STEP_TIMEOUT = 60.0
SKIPPED = 3  # the exit code of a file whose blocks cannot run here (a missing optional package)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
FENCE = re.compile(
    r"(?P<before>(?:<!--[^\n]*-->\s*\n)?)^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$",
    re.M | re.S,
)
DIRECTIVE = re.compile(r"<!--\s*(docs-test|walkthrough):\s*(.*?)\s*-->")
STANDARD_PORTS = ("5556", "5557", "11011", "9092")


@dataclass
class Block:
    lang: str
    body: str
    line: int
    skip: str = ""  # why it does not run here ("" = it runs)


@dataclass
class Doc:
    path: Path
    blocks: list[Block] = field(default_factory=list)
    mesh: bool = False


def parse(path: Path) -> Doc:
    """The fenced blocks of a Markdown file, with their directives."""
    text = path.read_text(encoding="utf-8")
    doc = Doc(path, mesh="<!-- docs-test: mesh -->" in text)
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start("lang")) + 1
        skip = ""
        d = DIRECTIVE.search(m.group("before"))
        if d and d.group(1) == "walkthrough":
            skip = f"walkthrough {d.group(2)}: tests/test_multihost.py runs it on three hosts"
        elif d and d.group(2).startswith("skip"):
            skip = d.group(2).removeprefix("skip").strip() or "(no reason given)"
        doc.blocks.append(Block(m.group("lang"), m.group("body"), line, skip))
    return doc


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


class Sandbox:
    """A working directory, free ports and the services a document started."""

    def __init__(self, tmp: Path) -> None:
        self.cwd = tmp / "work"
        self.cwd.mkdir()
        self.ports = {p: str(free_port()) for p in STANDARD_PORTS}
        self.config = tmp / "ports.toml"
        tower = f"127.0.0.1:{self.ports['5556']}:{self.ports['5557']}"
        self.config.write_text(
            f'[node]\ntowers = ["{tower}"]\n'
            f"[tower]\nbeacon_in_port = {self.ports['5556']}\nbeacon_out_port = {self.ports['5557']}\n"
            f'[gateway]\nlisten = "127.0.0.1:{self.ports["11011"]}"\n'
        )
        env = {k: v for k, v in os.environ.items() if k not in ("DAFKA_TOWERS", "DAFKA_CONFIG")}
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["DAFKA_CONFIG"] = str(self.config)
        self.env = env
        self.services: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.jobs: dict[int, int] = {}  # shell job number -> index in services (as bash numbers jobs)

    def ported(self, text: str) -> str:
        """``text`` with the standard ports replaced by this sandbox's."""
        return re.sub(r"\b(5556|5557|11011|9092)\b", lambda m: self.ports[m.group(1)], text)

    def start(self, command: str, where: str) -> None:
        log = self.cwd.parent / f"service-{len(self.services)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["sh", "-c", command], cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.services.append((command, proc, log))
        self.jobs[max(self.jobs, default=0) + 1] = len(self.services) - 1
        deadline = time.monotonic() + STEP_TIMEOUT
        while not log.read_text(errors="replace").strip():  # ready: it printed its first line
            assert proc.poll() is None, f"{where}: exited {proc.returncode}: {log.read_text(errors='replace')}"
            assert time.monotonic() < deadline, f"{where}: printed nothing in {STEP_TIMEOUT:.0f} s"
            time.sleep(0.05)

    def stop(self, index: int) -> None:
        _, proc, _ = self.services[index]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def close(self) -> None:
        for i in reversed(range(len(self.services))):
            self.stop(i)

    def logs(self) -> str:
        return "\n".join(f"--- {cmd}\n{log.read_text(errors='replace')[-2000:]}" for cmd, _, log in self.services)


def shell_lines(body: str) -> list[str]:
    """The commands of a shell block: continuations joined, blank and comment lines dropped."""
    out: list[str] = []
    pending = ""
    for raw in body.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            out.append(line)
    return out


def run_shell(block: Block, box: Sandbox, where: str) -> None:
    for line in shell_lines(box.ported(block.body)):
        here = f"{where}: {line}"
        bare = re.sub(r"\s+#.*$", "", line)  # what the shell runs, without a trailing comment
        export = re.fullmatch(r"export (\w+)=(\S+)", bare)
        if export:
            box.env[export.group(1)] = os.path.expandvars(export.group(2))
        elif bare == "source .venv/bin/activate":
            continue
        elif re.fullmatch(r"kill( %\d+)+", bare):
            for job in bare.split()[1:]:
                assert int(job[1:]) in box.jobs, f"{here}: no job {job}"
                box.stop(box.jobs.pop(int(job[1:])))
        elif bare.endswith("&"):
            box.start(bare.removesuffix("&").strip(), here)
        else:
            out = subprocess.run(
                ["sh", "-c", line], cwd=box.cwd, env=box.env, capture_output=True, text=True, timeout=STEP_TIMEOUT
            )
            assert out.returncode == 0, (
                f"{here}\nexited {out.returncode}\nstdout: {out.stdout[-3000:]}\nstderr: {out.stderr[-3000:]}\n"
                f"{box.logs()}"
            )


def run_python(block: Block, box: Sandbox, namespace: dict[str, Any], where: str) -> None:
    code = compile(textwrap.dedent(box.ported(block.body)), where, "exec")
    exec(code, namespace)


def run_toml(block: Block, where: str) -> None:
    check_settings(tomllib.loads(block.body), where)


def run_doc(path: Path, tmp: Path) -> int:
    """Run every block of ``path`` in a sandbox under ``tmp``; the process exit code."""
    doc = parse(path)
    runnable = [b for b in doc.blocks if not b.skip]
    if any(b.lang == "python" and "pyspark" in b.body for b in runnable):
        try:
            import pyspark  # noqa: F401
        except ImportError:
            print("pyspark is not installed", file=sys.stderr)
            return SKIPPED
    box = Sandbox(tmp)
    os.chdir(box.cwd)
    os.environ.pop("DAFKA_TOWERS", None)
    os.environ["DAFKA_CONFIG"] = str(box.config)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    try:
        if doc.mesh:
            box.start("exec dafka up --data var", f"{rel(path)}: the mesh (dafka up)")
        for block in runnable:
            where = f"{rel(path)}:{block.line}"
            started = time.monotonic()
            if block.lang == "sh":
                run_shell(block, box, where)
            elif block.lang == "python":
                run_python(block, box, namespace, where)
            elif block.lang == "toml":
                run_toml(block, where)
            print(f"{where}: {block.lang} ran in {time.monotonic() - started:.1f} s", flush=True)
    finally:
        box.close()
    left = unignored(box.cwd)
    assert not left, (
        f"{rel(path)} leaves {', '.join(left)} in the directory it runs in (the repository's, for a reader),"
        " and git does not ignore it: keep a tutorial's state (keys, databases, outboxes) under var/"
    )
    return 0


def unignored(cwd: Path) -> list[str]:
    """What a document left in ``cwd`` that the repository's .gitignore would not ignore there."""
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in cwd.iterdir())
    if not names:
        return []
    # A path inside a directory is ignored when the directory is: ask about one.
    probes = {name + "x" if name.endswith("/") else name: name for name in names}
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "check-ignore", "--no-index", "--stdin"],
            input="\n".join(probes) + "\n", capture_output=True, text=True, timeout=30,
        )
    except FileNotFoundError:
        return []  # no git here: nothing to check against
    if out.returncode not in (0, 1):
        return []  # not a git checkout (an unpacked archive)
    ignored = set(out.stdout.splitlines())
    return [name for probe, name in probes.items() if probe not in ignored]


if __name__ == "__main__":
    sys.exit(run_doc(Path(sys.argv[1]).resolve(), Path(sys.argv[2])))
