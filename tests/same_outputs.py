"""Do the user-facing commands still write the same bytes? A script, not a test (about a minute).

    python tests/same_outputs.py --write tests/data/same_outputs.json   # on the commit to compare with
    python tests/same_outputs.py --check tests/data/same_outputs.json   # after a change

It runs `hilt quantize` of MiniLM (k-means 4-bit, int 4-bit), `hilt drift --model cnn`, a small
`hilt sweep` and `hilt certify mlp`, and records a SHA-256 per output file. JSON outputs are hashed
after dropping what may differ between runs or checkouts: wall times and absolute paths. An output may
list several digests: `hilt certify`'s norms come from BLAS, whose last bits may differ between CPUs, so its
entry holds the digest that the commit before the move wrote on each machine it was checked on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

GRID = """seed = 0
chips = 2
images = 300

[axes]
model = ["cnn"]
preset = ["pcm"]
adc_bits = [6]
gdc = ["none", "global"]
time = ["1s", "1d"]
"""

RUN_DEPENDENT = {"seconds", "path", "checkpoint", "wall_s", "elapsed_s"}


def _normalized(obj, top: bool = True):
    """JSON without wall times and paths (a row's ``seconds`` after programming is kept: it is data)."""
    if isinstance(obj, dict):
        return {k: _normalized(v, False) for k, v in obj.items()
                if not (k in RUN_DEPENDENT and (top or k != "seconds")) and not k.endswith("_seconds")}
    if isinstance(obj, list):
        return [_normalized(v, False) for v in obj]
    return obj


def _digest(path: Path) -> str:
    if path.suffix in (".json", ".jsonl"):
        lines = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
        text = "\n".join(json.dumps(_normalized(json.loads(line)), sort_keys=True) for line in lines if line)
        return hashlib.sha256(text.encode()).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hilt(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "hilt", *args, "-q"], cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL)


def _outputs(work: Path, minilm: str) -> dict[str, str]:
    _hilt("quantize", minilm, "mk4", "--method", "kmeans", "--bits", "4", cwd=work)
    _hilt("quantize", minilm, "mi4", "--method", "int", "--bits", "4", cwd=work)
    _hilt("drift", "--model", "cnn", "--times", "1s,1d", "--repeats", "2", "--test-images", "500",
          "--json", "drift.json", cwd=work)
    (work / "grid.toml").write_text(GRID)
    _hilt("sweep", "grid.toml", "--out", "sweep", "--no-plots", "--no-ray", cwd=work)
    _hilt("certify", "mlp", "--test-images", "100", "--json", "certify.json", cwd=work)
    files = [*sorted((work / "mk4").glob("*.*")), *sorted((work / "mi4").glob("*.*")),
             work / "drift.json", work / "sweep" / "results.jsonl", work / "certify.json"]
    return {str(f.relative_to(work)): _digest(f) for f in files}


def _minilm() -> str:
    try:
        from hilt.models.bert import minilm_path
    except ImportError:  # the commit before the move
        from hilt.bench.models.bert import minilm_path
    return str(minilm_path())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path)
    mode.add_argument("--check", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got = _outputs(Path(tmp), _minilm())
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} digests to {args.write}")
        return 0
    want = json.loads(args.check.read_text())
    bad = sorted(k for k in want.keys() | got.keys()
                 if got.get(k) not in (want[k] if isinstance(want.get(k), list) else [want.get(k)]))
    for k in bad:
        print(f"differs: {k}")
    print(f"{len(want) - len(bad)} of {len(want)} outputs the same")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
