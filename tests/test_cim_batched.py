"""Many chips in one pass, models and data a user brings, and aihwkit's drift compensation read-out."""

import dataclasses
import json
import textwrap

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from helpers import run_hilt
from hilt.cim_sim import convert_to_analog, drift_to, evaluate, preset, program
from hilt.cim_sim.analog import ChipForward
from hilt.errors import HiltError

# A user's own networks, written to a module outside the project by the tests below.
NETS = textwrap.dedent('''
    import torch
    from torch import nn


    class ConvMLP(nn.Module):
        """An MLP behind a Conv1d, on 2-channel sequences of 32."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 8, 5, padding=2)
            self.fc1 = nn.Linear(8 * 32, 600)  # two arrays of 300 inputs each on the second layer
            self.fc2 = nn.Linear(600, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


    class ResNetish(nn.Module):
        """A small ResNet-style CNN on 1 x 12 x 12 images."""

        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(1, 8, 3, padding=1)
            self.blocks = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
            self.fc = nn.Linear(16, 5)

        def forward(self, x):
            return self.fc(self.blocks(torch.relu(self.stem(x))).mean((2, 3)))


    def conv_mlp():
        torch.manual_seed(0)
        return ConvMLP()


    def resnet():
        torch.manual_seed(1)
        return ResNetish().eval()


    def not_a_module():
        return 3


    def no_layers():
        return nn.Sequential(nn.ReLU())


    def broken():
        raise ValueError("bad config")


    class Frames(nn.Module):
        """Reads each input as 4 frames of 8 (its batch times 4 rows), then the frames together."""

        def __init__(self):
            super().__init__()
            self.frame = nn.Linear(8, 8)
            self.head = nn.Linear(32, 5)

        def forward(self, x):
            return self.head(torch.relu(self.frame(x.reshape(-1, 8))).reshape(-1, 32))


    class Tied(nn.Module):
        """One block applied twice (shared), then attention, which reads its projections itself."""

        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(32, 16)
            self.block = nn.Linear(16, 16)
            self.again = self.block
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(16, 5)

        def forward(self, x):
            h = torch.relu(self.again(torch.relu(self.block(torch.relu(self.inp(x))))))
            a, _ = self.attn(*(h.view(-1, 4, 4),) * 3)
            return self.head(a.reshape(-1, 16))


    def frames():
        torch.manual_seed(2)
        return Frames()


    def tied():
        torch.manual_seed(3)
        return Tied()
''')

SHAPES = {"conv_mlp": (2, 32), "resnet": (1, 12, 12), "frames": (32,), "tied": (32,)}


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """The module on disk, imported; removed from sys.modules afterwards."""
    import importlib
    import sys

    folder = tmp_path_factory.mktemp("user")
    (folder / "user_nets.py").write_text(NETS)
    sys.path.insert(0, str(folder))
    try:
        yield folder, importlib.import_module("user_nets")
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("user_nets", None)


def teacher_data(model, shape, n=48, seed=0):
    """Random inputs labelled by the digital model itself: its accuracy is 1, a chip's shows the damage."""
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return x, model(x).argmax(1)


@pytest.mark.parametrize("factory,preset_name,gdc", [
    ("conv_mlp", "pcm", "global"), ("conv_mlp", "pcm", "aihwkit"), ("conv_mlp", "pcm-hwa", "column"),
    ("conv_mlp", "rram", "exact"), ("conv_mlp", "ideal", "none"), ("resnet", "pcm", "aihwkit"),
    ("resnet", "pcm-scaled", "global"), ("frames", "pcm", "global"), ("tied", "pcm", "global"),
])
def test_batched_chips_equal_one_chip_at_a_time(nets, factory, preset_name, gdc):
    _, module = nets
    model = getattr(module, factory)()
    data = teacher_data(model, SHAPES[factory])
    seeds, reads = [3, 7, 11], [5, 9, 13]
    chips = convert_to_analog(model, preset(preset_name))
    program(chips, seeds=seeds)
    drift_to(chips, 86400.0, seeds=reads, gdc=gdc)
    x = data[0][:10]
    with torch.no_grad():
        together = chips(x).view(3, 10, -1)
    accuracy = evaluate(chips, data, batch_size=16)  # the chips' forward noise continues in the same order
    assert together.isfinite().all() and accuracy.shape == (3,)
    for k, (seed, read) in enumerate(zip(seeds, reads, strict=True)):
        one = convert_to_analog(model, preset(preset_name))
        program(one, seed=seed)
        drift_to(one, 86400.0, seed=read, gdc=gdc)
        with torch.no_grad():
            alone = one(x)
        if preset_name == "ideal":  # the digital layers' own arithmetic, on K times the rows
            torch.testing.assert_close(alone, together[k], rtol=1e-5, atol=1e-6)
        else:  # each chip's arrays run on its own rows: bit for bit
            assert torch.equal(alone, together[k])
        assert float(evaluate(one, data, batch_size=16)[0]) == float(accuracy[k])
    assert torch.equal(together[0], together[1]) == (preset_name == "ideal")  # chips differ, unless ideal


def test_a_read_fixes_the_forward_noise(nets):
    """After drift_to, a chip's outputs depend on its seeds and inputs, not on what ran before."""
    model = nets[1].conv_mlp()
    chips = convert_to_analog(model, preset("pcm"))
    program(chips, seeds=[1, 2])
    x = torch.randn(6, 2, 32)
    with torch.no_grad():
        drift_to(chips, 60.0, seeds=[3, 4])
        first = chips(x)
        chips(x), drift_to(chips, 3600.0, seeds=[5, 6], gdc="none"), chips(x)
        drift_to(chips, 60.0, seeds=[3, 4])
        assert torch.equal(chips(x), first)
        assert not torch.equal(chips(x), first)  # the noise goes on from there


def test_chip_counts_are_checked(nets):
    model = nets[1].conv_mlp()
    chips = convert_to_analog(model, preset("pcm"))
    program(chips, seeds=[1, 2, 3])
    with pytest.raises(HiltError, match="3 read seeds|1 read seeds"):
        drift_to(chips, 1.0, seeds=[1])
    layer = chips.fc2
    layer.chip_forward = ChipForward(4)
    layer.chip_forward.stacked = True  # as after the forward's first analog layer
    with pytest.raises(HiltError, match=r"layer fc2 holding 3 chips got 5 input rows: expected the model's batch of 4"):
        layer(torch.randn(5, 600))
    with pytest.raises(HiltError, match="seeds must name at least one chip"):
        program(chips, seeds=[])
    from hilt.cim_sim.frozen import freeze

    with pytest.raises(HiltError, match="freeze takes one programmed chip; this model holds 3"):
        freeze(chips)


def test_shared_layers_convert_everywhere_and_attention_stays_digital(nets):
    chips = convert_to_analog(nets[1].tied(), "pcm")
    assert type(chips.again).__name__ == "AnalogLinear" and chips.again is chips.block
    assert chips.digital_layers == ["attn"]
    assert type(chips.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear


def test_only_analog_models_are_programmed(nets):
    for call in (lambda m: program(m, seeds=[1, 2]), lambda m: drift_to(m, 1.0)):
        with pytest.raises(HiltError, match="no analog layer; convert it with convert_to_analog first"):
            call(nets[1].conv_mlp())
    with pytest.raises(HiltError, match="stuck_at_rate: at least 0 and at most 1"):
        convert_to_analog(nets[1].conv_mlp(), dataclasses.replace(preset("pcm"), stuck_at_rate=1.5))
    with pytest.raises(HiltError, match=r"analog layer conv takes \(batch, channels, length\) inputs"):
        convert_to_analog(nets[1].conv_mlp(), "pcm").conv(torch.randn(2, 32))


def test_evaluate_refuses_bad_data(nets):
    model = nets[1].conv_mlp()
    x, y = teacher_data(model, (2, 32), n=8)
    with pytest.raises(HiltError, match="class indices"):
        evaluate(model, (x, y.float()))
    with pytest.raises(HiltError, match="as many inputs as labels"):
        evaluate(model, (x, y[:5]))
    with pytest.raises(HiltError, match=r"inputs of shape \(3, 32\) do not fit the model"):
        evaluate(model, (torch.randn(8, 3, 32), y))
    with pytest.raises(HiltError, match="labels run from 1 to 4, but the model has 4 outputs"):
        evaluate(model, (x, torch.arange(8) % 4 + 1))
    with pytest.raises(HiltError, match="evaluate takes torch tensors"):
        evaluate(model, (x.numpy(), y))
    assert float(evaluate(model, (x, y))[0]) == 1.0  # a digital model is one chip


def test_tiles_split_like_aihwkit():
    def bounds(n_in):
        from hilt.cim_sim import AnalogLinear

        return AnalogLinear(nn.Linear(n_in, 3), preset("pcm")).tile_bounds()

    assert bounds(784) == [(0, 392), (392, 784)]
    assert bounds(1568) == [(0, 392), (392, 784), (784, 1176), (1176, 1568)]
    assert bounds(513) == [(0, 257), (257, 513)]
    assert bounds(25) == [(0, 25)]


def test_aihwkit_compensation_is_per_array_mean_abs_weight():
    """Without converter noise or quantization the read-out of the identity is the array's mean |w|:
    each array's factor is its programmed mean |w| over its drifted one."""
    import dataclasses

    torch.manual_seed(0)
    quiet = dataclasses.replace(preset("pcm"), dac_bits=None, adc_bits=None, out_noise=0.0, bound_management=False)
    model = convert_to_analog(nn.Sequential(nn.Linear(700, 5)), quiet)
    program(model, seeds=[0, 1])
    chips = model[0]
    pool = model.device_pools[0]
    programmed = (pool["g"][:, 0] - pool["g"][:, 1]).view(2, 5, 700)
    drift_to(model, 3.15e7, seeds=[2, 3], gdc="aihwkit")
    now = chips.w_eff
    for i, (k0, k1) in enumerate(chips.tile_bounds()):
        want = programmed[..., k0:k1].abs().mean((1, 2)) / now[..., k0:k1].abs().mean((1, 2))
        torch.testing.assert_close(chips.tile_scale[:, i], want, rtol=1e-5, atol=0)
    assert float(chips.tile_scale.min()) > 1.05  # a year of drift: the factors restore lost conductance
    assert torch.equal(chips.gdc_scale, torch.ones(2, 5))


@pytest.fixture(scope="module")
def user_files(nets):
    """A checkpoint and a data file for each network, as a user would have them."""
    folder, module = nets
    files = {}
    for name in ("conv_mlp", "resnet"):
        shape = SHAPES[name]
        model = getattr(module, name)()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)  # weights of its own, so that loading the checkpoint matters
        x, y = teacher_data(model, shape, n=64)
        save_file(model.state_dict(), str(folder / f"{name}.safetensors"))
        if name == "conv_mlp":
            np.savez(folder / f"{name}.npz", inputs=x.numpy(), labels=y.numpy())
        else:
            save_file({"inputs": x, "labels": y}, str(folder / f"{name}-data.safetensors"))
    files["conv_mlp"] = ("conv_mlp.safetensors", "conv_mlp.npz")
    files["resnet"] = ("resnet.safetensors", "resnet-data.safetensors")
    return folder, files


@pytest.mark.parametrize("name", ["conv_mlp", "resnet"])
def test_drift_runs_a_users_model_and_data(user_files, name):
    folder, files = user_files
    checkpoint, data = files[name]
    r = run_hilt("drift", "--model", f"user_nets:{name}", "--checkpoint", checkpoint, "--data", data,
                 "--times", "1s,1y", "--repeats", "3", "--json", "out.json", cwd=folder)
    assert r.returncode == 0, r.stderr
    result = json.loads((folder / "out.json").read_text())
    assert result["digital_accuracy"] == 1.0  # the checkpoint was loaded: its own outputs are the labels
    assert result["test_images"] == 64 and result["data"] == data and result["repeats"] == 3
    assert all(len(row["all"]) == 3 and 0 <= row["worst"] <= row["mean"] <= 1 for row in result["rows"])
    year = {row["gdc"]: row["mean"] for row in result["rows"] if row["time"] == "1y"}
    assert year["global"] > year["none"]  # drift compensation pays off on these networks too


@pytest.mark.parametrize("args,needle", [
    (["--model", "missing_nets:net"], "cannot import missing_nets: ModuleNotFoundError"),
    (["--model", "user_nets:not_a_module"], "not_a_module() returned int, not a torch.nn.Module"),
    (["--model", "user_nets:no_layers"], "no Linear, Conv1d or Conv2d layer"),
    (["--model", "user_nets:conv_mlp", "--data", "resnet-data.safetensors"], "do not fit the model"),
])
def test_drift_refuses_what_does_not_fit(user_files, args, needle):
    folder, _ = user_files
    r = run_hilt("drift", *args, "--repeats", "1", "--times", "1s", "--json", "bad.json", cwd=folder)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.strip().splitlines() if "without --checkpoint" not in line]  # that warning aside
    assert len(errors) == 1 and needle in errors[0], r.stderr
    assert not (folder / "bad.json").exists()


def test_model_and_data_loading_errors(user_files):
    from hilt.tasks.cim_inputs import load_data, load_model

    folder, _ = user_files
    with pytest.raises(HiltError, match="broken\\(\\) failed: ValueError: bad config"):
        load_model("user_nets:broken")
    with pytest.raises(HiltError, match="has no function 'nothing'"):
        load_model("user_nets:nothing")
    with pytest.raises(HiltError, match="resnet.safetensors does not fit user_nets:conv_mlp: missing: conv.weight"):
        load_model("user_nets:conv_mlp", folder / "resnet.safetensors")
    torch.save({"w": torch.ones(1)}, folder / "model.pt")
    with pytest.raises(HiltError, match="read as .safetensors only"):
        load_model("user_nets:conv_mlp", folder / "model.pt")
    np.savez(folder / "nolabels.npz", inputs=np.zeros((3, 2, 32), np.float32))
    with pytest.raises(HiltError, match="nolabels.npz: no tensor named labels"):
        load_data(folder / "nolabels.npz")
    np.savez(folder / "objects.npz", inputs=np.zeros((2, 2)), labels=np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(HiltError, match="without pickle"):
        load_data(folder / "objects.npz")
    np.savez(folder / "float_labels.npz", inputs=np.zeros((2, 2), np.float32), labels=np.zeros(2, np.float32))
    with pytest.raises(HiltError, match="integer class indices"):
        load_data(folder / "float_labels.npz")
    with pytest.raises(HiltError, match="data files are .safetensors or .npz"):
        load_data(folder / "model.pt")
    (folder / "cut.npz").write_bytes((folder / "conv_mlp.npz").read_bytes()[:100])
    with pytest.raises(HiltError, match="cut.npz: not a readable .npz file"):
        load_data(folder / "cut.npz")
    state = load_file(folder / "conv_mlp.safetensors")
    save_file({**state, "fc2.weight": torch.zeros(5, 600)}, str(folder / "wide.safetensors"))
    with pytest.raises(HiltError, match="wide.safetensors does not fit user_nets:conv_mlp: size mismatch for fc2.weight"):
        load_model("user_nets:conv_mlp", folder / "wide.safetensors")
    x, y = load_data(folder / "conv_mlp.npz", limit=10)
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (10, 2, 32)
