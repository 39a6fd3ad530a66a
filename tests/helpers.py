"""What several test modules share (imported as ``from helpers import ...``)."""

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


def make_checkpoint(path: Path, n_layers: int = 2, hidden: int = 128, seed: int = 0) -> dict:
    """A small Llama-like safetensors checkpoint with real-looking names."""
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(64, hidden, generator=g)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
        t[p + "mlp.up_proj.weight"] = torch.randn(2 * hidden, hidden, generator=g) * 0.05
        t[p + "mlp.down_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.05
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
    t["lm_head.weight"] = torch.randn(64, hidden, generator=g)
    save_file(t, str(path))
    return t


# What a process reads from its environment only as it starts (the interpreter, OpenMP, torch's and the
# math libraries' settings): a command whose environment differs there from the command server's runs
# in a fresh interpreter instead.
_STARTUP_ENV = re.compile(r"^(PYTHON(?!BREAKPOINT)|OMP_|KMP_|MKL_|OPENBLAS_|GOMP_|LD_|TORCH|CUDA|MALLOC)")
_server = None


def _startup(env: dict) -> dict:
    return {k: v for k, v in env.items() if _STARTUP_ENV.match(k)}


class _CommandServer:
    """tests/command_server.py, one per test process: each command a forked child of a process that has
    imported torch and hilt once (saving their ~3 s of start-up per command)."""

    def __init__(self, env: dict):
        self.env = _startup(env)
        self.folder = Path(tempfile.mkdtemp(prefix="hilt-commands-"))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("command_server.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=self.folder)
        self.lock = threading.Lock()
        atexit.register(self.close)

    def run(self, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "hilt", *args]
        with self.lock:
            out, err = self.folder / "stdout", self.folder / "stderr"
            request = {"args": args, "cwd": str(cwd or os.getcwd()), "env": env, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self._answer())["pid"]
            answer = {}

            def read():
                try:
                    answer.update(json.loads(self._answer()))
                except RuntimeError as e:
                    answer["error"] = e
            reader = threading.Thread(target=read)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                os.kill(pid, signal.SIGKILL)
                reader.join()
                raise subprocess.TimeoutExpired(command, timeout)
            if "error" in answer:
                raise answer["error"]
            return subprocess.CompletedProcess(command, answer["rc"], out.read_text(), err.read_text())

    def _answer(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests/command_server.py stopped (exit status {self.proc.wait()}); its stderr is in "
                               "the test's output")
        return line

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_hilt(*args, cwd=None, timeout=300):
    """Run the real command line as a user would, `python -m hilt ARGS` in a process of its own (the
    commands choose Triton's interpreter themselves where they need it); returns CompletedProcess."""
    global _server
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = "ignore"
    args = [str(a) for a in args]
    if _server is None:
        _server = _CommandServer(env)
    if _startup(env) != _server.env:
        return subprocess.run([sys.executable, "-m", "hilt", *args], capture_output=True, text=True,
                              cwd=cwd, timeout=timeout, env=env)
    return _server.run(args, cwd, env, timeout)


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Where a module imports it: hilt's side on one thread, as llama.cpp's tools run: correctness checks,
    and on shared cores a second thread mostly waits (a 64-token forward took 1.9 s on two busy cores, 0.55 s
    on one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
