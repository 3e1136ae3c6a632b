"""The user guide: its code examples run, its links hold, and the site builds without a warning.

Every ```python block of a guide page (the pages in mkdocs.yml's nav, except the measured results and the
generated API reference) runs here: a page's blocks in order, in one namespace, in a fresh working directory,
as a reader pasting them one after the other would. What cannot run here (MNIST downloads, mpiexec) is written
as ```bash or ```text, never as Python: a guide page's fences may only name the languages in ``FENCE_LANGUAGES``.
"""

from __future__ import annotations

import linecache
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from fedlayer.cli import main as fedlayer_main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
RESULTS_INDEX = RESULTS / "README.md"

# ```lang ... ``` at the start of a line; the body is everything up to the closing fence.
FENCE = re.compile(r"^```[ \t]*(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.S | re.M)
FENCE_LANGUAGES = {"python", "bash", "text", "json"}
# Markdown links and images: [text](target) or ![alt](target), target without spaces.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _nav_pages(nav):
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            yield from _nav_pages(value)
        else:
            yield value


def guide_pages():
    """The nav's pages that a reader follows (not the measured results, not the generated reference)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return [page for page in _nav_pages(config["nav"]) if not page.startswith(("results/", "api/"))]


def code_blocks(path):
    """[(language, first line number of the body, body)] of a markdown file, in order (none if it is missing)."""
    text = path.read_text() if path.is_file() else ""  # a missing page fails test_guide_pages_exist...
    return [(m["lang"], text.count("\n", 0, m.start("body")) + 1, m["body"]) for m in FENCE.finditer(text)]


PAGES_WITH_EXAMPLES = [page for page in guide_pages()
                       if any(lang == "python" for lang, _, _ in code_blocks(DOCS / page))]


def test_guide_pages_exist_and_have_examples():
    missing = [page for page in guide_pages() if not (DOCS / page).is_file()]
    assert not missing, f"pages named in mkdocs.yml's nav but not in docs/: {missing}"
    # The pages a newcomer reads first show code that runs.
    assert {"getting-started.md", "kernels.md", "cli.md", "secure.md"} <= set(PAGES_WITH_EXAMPLES)


@pytest.mark.parametrize("page", ["../README.md", *guide_pages()])
def test_code_fences_name_a_known_language(page):
    unknown = [(line, lang) for lang, line, _ in code_blocks(DOCS / page) if lang not in FENCE_LANGUAGES]
    assert not unknown, (f"docs/{page}: code fences at (line, language) {unknown}; use ```python for code that "
                         f"runs (tests/test_docs.py runs it) and one of {sorted(FENCE_LANGUAGES)} otherwise")


def run_python_blocks(path, workdir, monkeypatch):
    """Run the ```python blocks of a markdown file in order, in one namespace, from ``workdir``."""
    monkeypatch.chdir(workdir)  # examples that write files write them here
    namespace = {"__name__": "__guide__"}
    for lang, line, body in code_blocks(path):
        if lang == "python":
            name = f"{path.relative_to(ROOT)}, block at line {line}"
            linecache.cache[name] = (len(body), None, body.splitlines(keepends=True), name)  # for tracebacks
            exec(compile(body, name, "exec"), namespace)


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES)
def test_guide_examples_run(page, tmp_path, monkeypatch):
    run_python_blocks(DOCS / page, tmp_path, monkeypatch)


def test_readme_examples_run(tmp_path, monkeypatch):
    assert any(lang == "python" for lang, _, _ in code_blocks(ROOT / "README.md"))
    run_python_blocks(ROOT / "README.md", tmp_path, monkeypatch)


def test_site_builds_without_warnings(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = build.stdout + build.stderr
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    assert "WARNING" not in output, f"mkdocs build --strict warned:\n{output}"
    assert (tmp_path / "site" / "api" / "fastls" / "index.html").is_file()


def _linked_files(page):
    """The local files a markdown page links to (resolved paths), without anchors and queries."""
    targets = set()
    for target in LINK.findall(page.read_text()):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc or not parts.path:
            continue  # a web address, or an anchor on the same page
        targets.add((page.parent / unquote(parts.path)).resolve())
    return targets


def results_files():
    """The files under docs/results that belong to the project: tracked or new, not ignored by git.

    Ignored files are outputs of experiments in progress (``docs/results/*.json`` until committed); without
    git (an unpacked archive), every file.
    """
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                                 str(RESULTS)], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {path.resolve() for path in RESULTS.rglob("*") if path.is_file()}
    return {(ROOT / name).resolve() for name in listed.decode().split("\0") if name and (ROOT / name).is_file()}


def test_results_index_reaches_every_results_file():
    reached, todo = {RESULTS_INDEX.resolve()}, [RESULTS_INDEX.resolve()]
    while todo:
        page = todo.pop()
        for target in _linked_files(page):
            if target not in reached and target.is_file() and RESULTS in target.parents:
                reached.add(target)
                if target.suffix == ".md":
                    todo.append(target)
    files = results_files()
    unreached = sorted(str(path.relative_to(RESULTS)) for path in files - reached)
    assert not unreached, f"docs/results files that no link from docs/results/README.md leads to: {unreached}"


def _run_flags(capsys):
    with pytest.raises(SystemExit):
        fedlayer_main(["run", "--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out)) - {"--help"}


def test_cli_page_names_every_run_option(capsys):
    flags = _run_flags(capsys)
    assert {"--algorithm", "--config", "--secure", "--mpi-deadline"} <= flags
    page = (DOCS / "cli.md").read_text()
    missing = sorted(flag for flag in flags if not re.search(rf"`{re.escape(flag)}[`\s=]", page))
    assert not missing, f"`fedlayer run` options that docs/cli.md does not describe: {missing}"


def _bash_blocks(text):
    return [m["body"] for m in FENCE.finditer(text) if m["lang"] == "bash"]


def test_getting_started_quotes_the_readme_commands():
    readme = _bash_blocks((ROOT / "README.md").read_text())[:2]
    assert len(readme) == 2 and "fedlayer run" in readme[0] and "pytest" in readme[1]
    getting_started = _bash_blocks((DOCS / "getting-started.md").read_text())
    assert getting_started[:2] == readme


def test_readme_links_the_guide():
    readme = (ROOT / "README.md").read_text()
    assert "mkdocs serve" in readme
    for target in _linked_files(ROOT / "README.md"):
        assert target.exists(), f"README.md links to {target}, which does not exist"


def test_bench_readme_says_how_to_run_benchmarks_briefly():
    text = (ROOT / "bench" / "README.md").read_text()
    assert len(text.splitlines()) < 150, "bench/README.md is the how-to; measurements go to docs/results"
    for needed in ("--benchmark-enable", "--benchmark-save", "--benchmark-compare", "bench_history.md"):
        assert needed in text
