"""hilt as an installed package: one `hilt` namespace, imports that go one way, light imports.

The packaging tests build the real wheel and sdist and install them into a scratch folder, next to
Hugging Face's `kernels` package (whose import name the kernels folder would otherwise take).
"""

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder at the repository root -> installed package
FOLDERS = {"kernels": "hilt.kernels", "quant": "hilt.quant", "fp8": "hilt.fp8", "cim_sim": "hilt.cim_sim",
           "bench": "hilt.bench", "hilt": "hilt"}
# Which way imports go: a package imports only packages of a lower rank (and itself). The modules
# of hilt/ that import nothing of the project (the error class, the version in hilt/__init__.py, whole-file
# writes, progress lines) are the ground every package stands on; the rest of hilt/ is the command line.
GROUND = ("hilt", "hilt.errors", "hilt.progress", "hilt.atomic")
# cim_sim stands on quant (module replacement; quantized models on analog arrays), never the reverse.
# Above the library: the data readers, the model definitions (which read text), the tasks user commands
# run, the measurements (bench), and the command line.
# The error class lies below the other ground modules, which raise it.
RANK = {**dict.fromkeys(GROUND, 0.5), "hilt.errors": 0, "hilt.kernels": 1, "hilt.quant": 2, "hilt.fp8": 2, "hilt.cim_sim": 3,
        "hilt.data": 4, "hilt.models": 5, "hilt.tasks": 6, "hilt.bench": 7, "hilt (CLI)": 8}
HEAVY = ("triton", "onnx", "onnxruntime", "matplotlib", "transformers", "ray")
# The one import that goes up, on purpose: `import hilt` registers hilt's quantizer with transformers,
# importing it only when transformers' quantizer registry is itself imported (a post-import hook).
PLUGIN_HOOKS = {("hilt/__init__.py", "hilt.quant.hf_quantizer")}


def _package_of(module: str) -> str:
    """The unit the import rule speaks of: a ground module, a package (library, data, models, tasks,
    bench) or the CLI."""
    parts = module.split(".")
    if parts[0] != "hilt":
        return module
    unit = ".".join(parts[:2])
    return unit if unit in RANK else "hilt (CLI)"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = FOLDERS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path):
    """(line, imported module) for every import in the file, function-level ones included."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                yield node.lineno, "." * node.level + (node.module or "")
            else:
                yield node.lineno, node.module


def _sources():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_imports_go_one_way():
    upward, bare, relative = [], [], []
    edges: dict[str, set[str]] = {}
    for path in _sources():
        source = _package_of(_module_name(path))
        for line, target in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if target.startswith("."):
                relative.append(where)
                continue
            top = target.split(".")[0]
            if top in FOLDERS and top != "hilt":
                bare.append(where)  # the installed names are hilt.*; bare ones belong to other projects
                continue
            if top != "hilt":
                continue
            dest = _package_of(target)
            if dest == source:
                continue
            edges.setdefault(source, set()).add(dest)
            if RANK.get(dest, 99) >= RANK.get(source, 99) and (str(path.relative_to(ROOT)), target) not in PLUGIN_HOOKS:
                upward.append(where)
    assert not bare, "imports of the bare folder names:\n" + "\n".join(bare)
    assert not relative, "relative imports (the rule is checked on absolute names):\n" + "\n".join(relative)
    assert not upward, "imports that go up or sideways:\n" + "\n".join(upward)
    assert "hilt.bench" not in {d for s, ds in edges.items() if s not in ("hilt (CLI)", "hilt.bench") for d in ds}


def test_the_import_rule_catches_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: a library module importing bench is reported."""
    fake = ROOT / "quant" / "_upward_probe.py"
    monkeypatch.setattr(sys.modules[__name__], "_sources", lambda: [fake])
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "def f():\n    from hilt.models import llama\n")
    with pytest.raises(AssertionError, match="quant/_upward_probe.py:2 imports hilt.models"):
        test_imports_go_one_way()


def _python(code: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_importing_hilt_is_light_and_changes_no_environment(tmp_path):
    code = (
        "import os, sys, json\n"
        "before = dict(os.environ)\n"
        "import hilt, hilt.errors, hilt.kernels, hilt.quant, hilt.fp8, hilt.cim_sim, hilt.bench, hilt.cli\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps({'heavy': heavy, 'env_changed': dict(os.environ) != before}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    r = _python(code, tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"heavy": [], "env_changed": False}


@pytest.mark.parametrize("args,light", [(["--help"], ("torch", "triton")), (["--version"], ("torch", "triton")),
                                        (["quantize", "--help"], ("torch", "triton")), (["drift", "--help"], ("triton",))])
def test_cli_help_and_version_import_no_triton(tmp_path, args, light):
    """`hilt --help`, `--version` and `hilt quantize --help` import no torch; a command's --help that
    lists the library's choices imports its library but no Triton."""
    code = (
        "import sys\n"
        "from hilt.cli import main\n"
        f"try:\n    main({args!r})\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        f"assert not [m for m in {light!r} if m in sys.modules], 'heavy import'\n"
    )
    r = _python(code, tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The wheel and the sdist of this checkout, and a wheel built from that sdist."""
    out = tmp_path_factory.mktemp("dist")
    # built from a copy: a build leaves build/ behind, whose stale files a later build would package
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             "report", ".gpu", ".hypothesis", ".pytest_cache"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    r = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out / "wheel"), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out / 'sdist')!r})"],
                       capture_output=True, text=True, cwd=src, timeout=600)
    assert r.returncode == 0, r.stderr
    sdist = next((out / "sdist").glob("hilt-*.tar.gz"))
    r = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out / "from-sdist"), str(sdist)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return next((out / "wheel").glob("hilt-*.whl")), next((out / "from-sdist").glob("hilt-*.whl"))


def _top_level(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {name.split("/")[0] for name in z.namelist()}


def test_wheel_and_sdist_install_only_hilt(built):
    for wheel in built:
        top = _top_level(wheel)
        assert {t for t in top if not t.endswith(".dist-info")} == {"hilt"}, (wheel.name, top)
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
        for module in ("hilt/kernels/lut_matmul_triton.py", "hilt/models/llama.py", "hilt/cli/quantize.py",
                       "hilt/models/trained/cnn-standard.safetensors", "hilt/bench/perf/gpu_check.sh",
                       "hilt/data/lm_tasks/winters_tale.json"):
            assert module in names, (wheel.name, module)


def test_installed_beside_hugging_face_kernels(built, tmp_path):
    """Installed in a folder of its own: the bare name `kernels` is free, Hugging Face's `kernels`
    installs beside it, and both import; `hilt quantize` still works there."""
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps", "--target",
           str(target)]
    r = subprocess.run([*pip, str(built[0])], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    work = tmp_path / "work"
    work.mkdir()
    r = _python("import hilt.kernels\nimport kernels", work, env)
    assert r.returncode != 0 and "No module named 'kernels'" in r.stderr, r.stderr

    r = subprocess.run([*pip, "kernels"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"Hugging Face's kernels package is not installable here: {r.stderr.strip().splitlines()[-1:]}")
    r = _python("import kernels, hilt.kernels\n"
                "print(kernels.__file__); print(hilt.kernels.__file__)\n"
                "assert hasattr(kernels, 'get_kernel')", work, env)
    assert r.returncode == 0, r.stderr
    hf_file, hilt_file = r.stdout.split()
    assert Path(hf_file).is_relative_to(target / "kernels")
    assert Path(hilt_file).is_relative_to(target / "hilt" / "kernels")

    from helpers import make_checkpoint

    make_checkpoint(work / "tiny.safetensors")
    r = subprocess.run([sys.executable, "-m", "hilt", "quantize", "tiny.safetensors", "q", "--bits", "4"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (work / "q" / "hilt.json").exists()


def test_without_triton_the_cpu_path_runs_and_gpu_kernels_say_why(tmp_path):
    """As on macOS or Windows, where Triton has no wheels: everything on CPU tensors works, and
    asking for the Triton kernels is one clear error."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # import triton now raises ImportError\n"
        "import torch\n"
        "from hilt.errors import HiltError\n"
        "from hilt.quant import QuantConfig, QuantLinear, quantize_model_\n"
        "from hilt.kernels.backends import triton_kernels\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(128, 64))\n"
        "x = torch.randn(3, 128)\n"
        "ref = model(x)\n"
        "quantize_model_(model, QuantConfig('kmeans', 4))\n"
        "assert isinstance(model[0], QuantLinear)\n"
        "err = float((model(x) - ref).norm() / ref.norm())\n"
        "assert 0 < err < 0.2, err\n"
        "try:\n    triton_kernels('lut_matmul_triton')\nexcept HiltError as e:\n    print(e)\n"
    )
    r = _python(code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Triton is not installed" in r.stdout


def test_startup_benchmark_measures_both_in_one_run(tmp_path):
    from helpers import read_json, run_hilt

    r = run_hilt("bench", "startup", "--repeats", "1", "--json", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    med = read_json(tmp_path / "s.json")["median_s"]
    assert set(med) == {"python -c pass", "import torch", "hilt --help", "hilt quantize --help", "hilt --version"}
    assert all(t > 0 for t in med.values())


def test_quantize_method_choices_are_the_format_registry():
    from hilt.cli.common import QUANT_METHODS
    from hilt.quant.formats import METHODS

    assert tuple(QUANT_METHODS) == tuple(METHODS)


def test_startup_target_is_over_the_bare_interpreter():
    from hilt.bench.perf.startup import summarize

    fast = {"python -c pass": 0.02, "import torch": 1.5, "hilt --help": 0.3, "hilt quantize --help": 0.31,
            "hilt --version": 0.1}
    r = summarize(fast, 1)
    assert r["excess_over_python_s"]["hilt --help"] == pytest.approx(0.28) and r["met"]
    assert not summarize({**fast, "hilt quantize --help": 0.33}, 1)["met"]  # one command over: missed
    assert not summarize({**fast, "hilt --help": 0.5}, 1)["met"]  # from the interpreter: against torch it would pass



def test_the_checkout_root_stays_importable_for_other_packages(tmp_path):
    """Python started in the checkout root finds hilt's top-level folders (kernels/, quant/, ...) by their bare names;
    transformers probes for a `kernels` package of its own. A model still loads and runs there after `import hilt`."""
    pytest.importorskip("transformers")
    code = (f"import transformers, hilt, torch\n"
            f"c = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
            f"num_attention_heads=2, num_key_value_heads=1)\n"
            f"transformers.LlamaForCausalLM(c).save_pretrained({str(tmp_path / 'tiny')!r})\n"
            f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'tiny')!r})\n"
            f"print(tuple(m(torch.tensor([[1, 2]])).logits.shape))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("(1, 2, 64)"), r.stderr[-2000:]
