"""Fashion-MNIST loader, the MLP/CNN workloads, their training and their checkpoints (bench/)."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hilt.data import fashion_mnist
from hilt.data.fashion_mnist import DEFAULT_ROOT, load_fashion_mnist
from hilt.models.classifiers import CNN, MLP, WORKLOADS, build
from hilt.cim_sim import evaluate
from hilt.tasks.train import load_workload, save_workload, train, train_run
from hilt.cim_sim.training import NoisyTraining
from hilt.errors import HiltError

FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
         "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


@pytest.fixture(scope="module")
def fmnist():
    if not all((DEFAULT_ROOT / f).is_file() for f in FILES):
        pytest.skip("Fashion-MNIST not installed: apt-get install -y dataset-fashion-mnist (scripts/setup.sh)")
    return load_fashion_mnist("train"), load_fashion_mnist("test")


def write_idx(path: Path, magic: int, dims, data: bytes) -> None:
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in dims)
    with gzip.open(path, "wb") as f:
        f.write(header + data)


def write_dataset(root: Path, n_train=3, n_test=2, seed=0) -> tuple[np.ndarray, np.ndarray]:
    """A tiny valid Fashion-MNIST-shaped dataset in IDX files; returns (train images, test images) as uint8."""
    rng = np.random.default_rng(seed)
    out = []
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", 0x803, (n, 28, 28), images.tobytes())
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", 0x801, (n,), labels.tobytes())
        out.append(images)
    return out[0], out[1]


# ---------------------------------------------------------------- the loader

def test_loader_shapes_dtypes_labels(fmnist):
    (x, y), (xt, yt) = fmnist
    assert x.shape == (60000, 1, 28, 28) and xt.shape == (10000, 1, 28, 28)
    assert x.dtype == xt.dtype == torch.float32
    assert y.dtype == yt.dtype == torch.int64
    # Fashion-MNIST is balanced: 6,000 training and 1,000 test images per class.
    assert torch.equal(torch.bincount(y, minlength=10), torch.full((10,), 6000))
    assert torch.equal(torch.bincount(yt, minlength=10), torch.full((10,), 1000))
    # Normalised with the training statistics: mean 0 and std 1 on the training split.
    assert abs(x.double().mean().item()) < 1e-4
    assert abs(x.double().std().item() - 1) < 1e-4
    mean, std = fashion_mnist.train_stats()
    assert 0.28 < mean < 0.29 and 0.35 < std < 0.36  # the published Fashion-MNIST statistics
    assert x.min().item() == pytest.approx(-mean / std, abs=1e-5)
    assert x.max().item() == pytest.approx((1 - mean) / std, abs=1e-5)
    # The splits are different images.
    assert not torch.equal(x[:10000], xt)
    assert not torch.equal(y[:10000], yt)


def test_loader_returns_fresh_tensors(fmnist):
    (x, _), _ = fmnist
    again, _ = load_fashion_mnist("train")
    again[0].fill_(123.0)
    third, _ = load_fashion_mnist("train")
    assert torch.equal(third[0], x[0])
    first, labels = load_fashion_mnist("train", limit=5)
    assert torch.equal(first, x[:5]) and labels.shape == (5,)


def test_loader_normalisation_matches_formula(tmp_path):
    train_u8, test_u8 = write_dataset(tmp_path)
    x, y = load_fashion_mnist("train", root=tmp_path)
    xt, _ = load_fashion_mnist("test", root=tmp_path)
    scaled = train_u8.astype(np.float64) / 255
    mean, std = scaled.mean(), scaled.std()
    want = (test_u8.astype(np.float64) / 255 - mean) / std
    np.testing.assert_allclose(xt[:, 0].numpy(), want, rtol=1e-5, atol=1e-5)
    assert x.shape == (3, 1, 28, 28) and y.shape == (3,)


def test_loader_refuses_wrong_magic(tmp_path):
    write_dataset(tmp_path)
    bad = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(bad, 0x801, (3, 28, 28), bytes(3 * 784))  # the labels' magic on an images file
    with pytest.raises(HiltError, match="magic") as e:
        load_fashion_mnist("train", root=tmp_path)
    assert str(bad) in str(e.value)


def test_loader_refuses_wrong_size(tmp_path):
    write_dataset(tmp_path)
    bad = tmp_path / "t10k-images-idx3-ubyte.gz"
    write_idx(bad, 0x803, (2, 28, 28), bytes(2 * 784 - 1))  # one byte short
    with pytest.raises(HiltError) as e:
        load_fashion_mnist("test", root=tmp_path)
    assert str(bad) in str(e.value)


def test_loader_refuses_label_count_mismatch(tmp_path):
    write_dataset(tmp_path)
    bad = tmp_path / "t10k-labels-idx1-ubyte.gz"
    write_idx(bad, 0x801, (3,), bytes(3))
    with pytest.raises(HiltError, match="3 labels for 2 images"):
        load_fashion_mnist("test", root=tmp_path)


def test_loader_refuses_non_gzip(tmp_path):
    write_dataset(tmp_path)
    bad = tmp_path / "train-labels-idx1-ubyte.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(HiltError) as e:
        load_fashion_mnist("train", root=tmp_path)
    assert str(bad) in str(e.value)


def test_loader_missing_files_say_how_to_install(tmp_path):
    with pytest.raises(HiltError, match="apt-get install -y dataset-fashion-mnist") as e:
        load_fashion_mnist("train", root=tmp_path)
    assert "\n" not in str(e.value)
    with pytest.raises(HiltError, match="split"):
        load_fashion_mnist("validation", root=tmp_path)


# ---------------------------------------------------------------- models

def test_workload_shapes_and_unknown_name():
    x = torch.randn(4, 1, 28, 28)
    assert set(WORKLOADS) == {"mlp", "cnn"}
    for name, cls in (("mlp", MLP), ("cnn", CNN)):
        model = build(name)
        assert isinstance(model, cls)
        assert model(x).shape == (4, 10)
    assert sum(p.numel() for p in build("mlp").parameters()) == 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    with pytest.raises(HiltError, match="cnn, mlp"):
        build("resnet")


def test_accuracy_counts_correct_predictions():
    class Fixed(torch.nn.Module):  # predicts class (first pixel value) for each image
        def forward(self, x):
            return torch.nn.functional.one_hot(x[:, 0, 0, 0].long(), 10).float()

    images = torch.zeros(10, 1, 28, 28)
    images[:, 0, 0, 0] = torch.arange(10).float()
    labels = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 0, 0])
    assert evaluate(Fixed(), (images, labels), batch_size=3).item() == pytest.approx(0.7)


# ---------------------------------------------------------------- training

@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_same_seed_same_weights(fmnist, name):
    a, _ = train(name, epochs=1, limit=512, seed=3)
    b, _ = train(name, epochs=1, limit=512, seed=3)
    c, _ = train(name, epochs=1, limit=512, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("name,limit", [("mlp", 6000), ("cnn", 3000)])
def test_short_training_beats_chance(fmnist, name, limit):
    _, (xt, yt) = fmnist
    seen = []
    model, history = train(name, epochs=2, limit=limit, on_epoch=lambda e, m, r: seen.append(e))
    assert seen == [1, 2] and [h["epoch"] for h in history] == [1, 2]
    assert history[1]["loss"] < history[0]["loss"]
    assert not model.training
    assert evaluate(model, (xt, yt)).item() > 0.6  # chance is 0.1


def test_train_refuses_bad_arguments():
    with pytest.raises(HiltError, match="standard"):
        train("mlp", training=NoisyTraining(method="magic"))
    with pytest.raises(HiltError, match="cnn, mlp"):
        train("vgg")
    with pytest.raises(HiltError, match="epochs"):
        train("mlp", epochs=0)
    with pytest.raises(HiltError, match="learning rate"):
        train("mlp", lr=-1.0)


def test_train_run_saves_and_refuses_overwrite(fmnist, tmp_path):
    out = tmp_path / "mlp.safetensors"
    result = train_run("mlp", epochs=1, seed=0, out=out, limit=1000)
    json.dumps(result)  # JSON-able
    assert result["workload"] == "mlp" and result["method"] == "standard" and result["epochs"] == 1
    assert result["train_images"] == 1000 and result["checkpoint"] == str(out)
    assert 0.3 < result["test_accuracy"] <= 1 and len(result["history"]) == 1
    model, meta = load_workload(out)
    _, (xt, yt) = fmnist
    assert evaluate(model, (xt, yt)).item() == result["test_accuracy"]
    assert meta["workload"] == "mlp" and meta["method"] == "standard" and meta["seed"] == "0"
    before = out.read_bytes()
    with pytest.raises(HiltError, match="already exists"):
        train_run("mlp", epochs=1, out=out, limit=100)
    assert out.read_bytes() == before
    train_run("mlp", epochs=1, seed=1, out=out, limit=100, overwrite=True)
    assert out.read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.safetensors"]  # no temporary left


# ---------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_checkpoint_round_trip(tmp_path, name):
    torch.manual_seed(7)
    model = build(name).eval()
    path = tmp_path / f"{name}.safetensors"
    save_workload(model, path, name, {"seed": 7, "note": "hello"})
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    loaded, meta = load_workload(path)
    assert isinstance(loaded, WORKLOADS[name]) and not loaded.training
    assert meta["workload"] == name and meta["seed"] == "7" and meta["note"] == "hello"
    x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(model(x), loaded(x))


def mlp_tensors() -> dict:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in build("mlp").state_dict().items()}


def _bad_cases():
    def drop(t):
        del t["fc3.bias"]

    def extra(t):
        t["fc4.weight"] = torch.zeros(10, 10)

    def shape(t):
        t["fc1.weight"] = torch.zeros(256, 783)

    def nan(t):
        t["fc2.weight"][3, 5] = float("nan")

    def inf(t):
        t["fc1.bias"][0] = float("inf")

    return [
        ("mismatch workload", lambda t: None, {"workload": "mlp"}, "cnn", "not 'cnn'"),
        ("tensors of another workload", lambda t: None, {"workload": "cnn"}, None, "missing"),
        ("missing tensor", drop, {"workload": "mlp"}, None, "fc3.bias"),
        ("extra tensor", extra, {"workload": "mlp"}, None, "fc4.weight"),
        ("wrong shape", shape, {"workload": "mlp"}, None, "fc1.weight"),
        ("nan", nan, {"workload": "mlp"}, None, "NaN"),
        ("inf", inf, {"workload": "mlp"}, None, "Inf"),
        ("no workload recorded", lambda t: None, {}, None, "workload"),
        ("unknown workload", lambda t: None, {"workload": "vgg"}, None, "vgg"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_checkpoint_raises_naming_file(tmp_path, case):
    _, edit, metadata, name, expect = case
    tensors = mlp_tensors()
    edit(tensors)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(HiltError, match=expect) as e:
        load_workload(path, name)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_checkpoint_without_metadata_loads_with_name(tmp_path):
    tensors = mlp_tensors()
    path = tmp_path / "plain.safetensors"
    save_file(tensors, str(path))
    model, meta = load_workload(path, "mlp")
    assert meta["workload"] == "mlp"
    assert all(torch.equal(model.state_dict()[k], tensors[k]) for k in tensors)


def test_unreadable_checkpoints(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 3 + b"not a safetensors file")
    bad_json = tmp_path / "bad_json.safetensors"
    bad_json.write_bytes((10).to_bytes(8, "little") + b"{notjson}!")
    for path in (garbage, bad_json, tmp_path / "absent.safetensors"):
        with pytest.raises(HiltError) as e:
            load_workload(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(HiltError) as e:
        save_workload(build("mlp"), tmp_path / "no" / "such" / "dir.safetensors", "mlp", {})
    assert "dir.safetensors" in str(e.value)
