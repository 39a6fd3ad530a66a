"""`hilt quantize --ray`: same bytes as a local run, a killed worker's tensor done again, bad input."""

import os
import sys
from pathlib import Path

import pytest

from hilt.bench.perf import scale
from hilt.cli import main
from hilt.quant import QuantConfig, quantize_checkpoint

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ray") / "llama"
    scale.write_synthetic(folder, "quick")
    return folder


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_no_ray_installed_is_one_line(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["quantize", str(model), str(tmp_path / "q"), "--ray", "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == "hilt: error: --ray needs Ray: pip install 'hilt[ray]'"
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


def test_unreachable_ray_address_is_one_line(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert main(["quantize", str(model), str(tmp_path / "q"), "--ray", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("hilt: error: cannot reach the Ray cluster at RAY_ADDRESS=127.0.0.1:1"), err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


def test_ray_equals_a_local_run_byte_for_byte(cluster, model, tmp_path):
    from hilt.tasks.quantize_ray import RayPool

    config = QuantConfig("kmeans", 3)
    quantize_checkpoint(model, tmp_path / "local", config, shard_bytes=100_000)
    with RayPool(2) as pool:
        written = quantize_checkpoint(model, tmp_path / "ray", config, shard_bytes=100_000, executor=pool)
    assert len(written.header["shards"]) > 2
    assert files(tmp_path / "local") == files(tmp_path / "ray")


def test_a_killed_worker_is_replaced_and_the_bytes_stay(cluster, model, tmp_path):
    from hilt.quant.checkpoint import quantize_one
    from hilt.tasks.quantize_ray import RayPool

    marker = tmp_path / "killed"
    victim = "model.layers.1.mlp.up_proj.weight"

    class Dying(RayPool):  # the job of one tensor kills its worker process the first time it runs
        def submit(self, fn, source, *args):
            def job(path, name, *rest):
                if name == victim and not marker.exists():
                    marker.touch()
                    os._exit(1)
                return quantize_one(path, name, *rest)
            return super().submit(job, source, *args)

    config = QuantConfig("int", 4)
    quantize_checkpoint(model, tmp_path / "local", config)
    with Dying(2) as pool:
        quantize_checkpoint(model, tmp_path / "ray", config, executor=pool)
    assert marker.exists()
    assert files(tmp_path / "local") == files(tmp_path / "ray")


def test_workers_without_ray_is_a_usage_error(model, tmp_path, capsys):
    assert main(["quantize", str(model), str(tmp_path / "q"), "--workers", "2"]) == 2
    assert "--workers applies with --ray only" in capsys.readouterr().err
