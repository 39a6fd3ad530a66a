"""The sweep grid: a TOML file read, checked and normalised into cells and groups, and the seeds
every cell derives from. The format, how cells and groups are formed and the seed rules:
docs/sweep.md."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from hilt.cim_sim import AnalogConfig, parse_time, preset
from hilt.cim_sim.config import FIELD_RANGES
from hilt.cim_sim.model import GDC_MODES
from hilt.errors import HiltError
from hilt.tasks.drift_lm import LANGUAGE_MODELS

FORMAT = "hilt-sweep/1"  # part of every seed: a change in how seeds derive must change this
TOP_KEYS = ("seed", "chips", "data", "images", "batch_size", "text", "tokens", "sentences", "axes", "models")
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(AnalogConfig))
AXES = ("model", "preset", *CONFIG_FIELDS, "chips", "gdc", "time")  # grid order, time innermost
GROUP_AXES = AXES[: AXES.index("gdc")]  # what a group's cells share
DEFAULTS = {"preset": ["pcm"], "gdc": ["global"]}
DEFAULT_CHIPS = 5
_OFF = "off"


@dataclass(frozen=True)
class Grid:
    path: Path
    seed: int
    data: str | None
    images: int | None
    batch_size: int | None
    axes: dict  # axis -> list of values as written (times as strings), in grid order (AXES)
    models: dict  # model name -> {"spec": str, "checkpoint": str | None}
    declared: tuple = ()  # the model names that have a [models.NAME] table
    language: dict = field(default_factory=dict)  # language models' text, tokens and sentences, where set

    def normalized(self) -> dict:
        """What the rows depend on, as JSON (DIR/grid.json): resume compares it with the grid file's."""
        models = {m: self.models[m] for m in self.axes["model"]}
        files = [f for f in (self.data, self.language.get("text"), *(e["checkpoint"] for e in models.values()),
                             *(e["spec"] for e in models.values() if e["spec"].endswith(".gguf")))
                 if f and f != "fashion-mnist"]
        return {"format": FORMAT, "seed": self.seed, "data": self.data, "images": self.images,
                "batch_size": self.batch_size, **self.language, "axes": self.axes, "models": models,
                # the files' contents too: a retrained checkpoint under the same name is another grid
                "sha256": {f: _sha256(self.path.parent / f) for f in sorted(set(files))}}

    def is_language_model(self, name: str) -> bool:
        return is_language_spec(self.models[name]["spec"], self.path.parent)

    def config(self, values: dict) -> AnalogConfig:
        fields = {k: values[k] for k in CONFIG_FIELDS if k in values}
        return dataclasses.replace(preset(values["preset"]), **fields)


@dataclass
class Cell:
    index: int  # position in grid order
    values: dict  # axis -> value, in grid order
    seconds: float
    group: int
    seed: int

    @property
    def key(self) -> str:
        return canonical(self.values)

    def label(self, grid: Grid) -> str:
        return " ".join(show(a, v) for a, v in self.values.items() if len(grid.axes[a]) > 1 or a == "time")


@dataclass
class Group:
    index: int
    model: str
    config: AnalogConfig
    chips: int
    seed: int
    cells: list = field(default_factory=list)


def is_language_spec(spec: str, folder: Path) -> bool:
    """smollm2, minilm, a GGUF file or a model folder (config.json) beside the grid: a language model."""
    return spec in LANGUAGE_MODELS or spec.endswith(".gguf") or (
        ":" not in spec and (folder / spec / "config.json").is_file())


def _sha256(path: Path) -> str | None:
    """The file's SHA-256 (None where it cannot be read: loading it reports that, with its name)."""
    try:
        st = path.stat()
        return _sha256_of(str(path.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        return None


@functools.lru_cache(maxsize=16)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def derive(*parts) -> int:
    """A 63-bit seed from JSON-able parts: SHA-256 of their canonical JSON."""
    return int.from_bytes(hashlib.sha256(canonical(list(parts)).encode()).digest()[:8], "little") >> 1


def program_seeds(seed: int, chips: int) -> list[int]:
    return [derive(seed, "program", k) for k in range(chips)]


def read_seeds(seed: int, seconds: float, chips: int) -> list[int]:
    return [derive(seed, "read", float(seconds), k) for k in range(chips)]


def show(axis: str, value) -> str:
    if axis == "time":
        return str(value)
    return f"{axis}={_OFF if value is None else value}"


def parse_grid(path) -> Grid:
    """Read and check a grid file; every mistake is a HiltError naming the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise HiltError(f"{path}: no such grid file")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise HiltError(f"{path}: not a valid TOML file ({e})") from None
    where = str(path)
    for key in raw:
        if key not in TOP_KEYS:
            raise HiltError(f"{where}: unknown key {key!r}; a grid has {', '.join(TOP_KEYS)}"
                            + (" (axes go under [axes])" if key in AXES else ""))

    def integer(key, lo, default):
        value = raw.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lo):
            raise HiltError(f"{where}: {key}: expected an integer >= {lo}, got {value!r}")
        return value

    seed = integer("seed", -(2**63), 0)
    images = integer("images", 1, None)
    batch_size = integer("batch_size", 1, None)
    data = raw.get("data")
    if data is not None and (not isinstance(data, str) or not data):
        raise HiltError(f"{where}: data: expected 'fashion-mnist' or a file name, got {data!r}")
    language = {k: v for k, v in (("text", raw.get("text")), ("tokens", integer("tokens", 2, None)),
                                  ("sentences", integer("sentences", 1, None))) if v is not None}
    if "text" in language and (not isinstance(language["text"], str) or not language["text"]):
        raise HiltError(f"{where}: text: expected a text file's name, got {language['text']!r}")

    axes_raw = raw.get("axes")
    if not isinstance(axes_raw, dict):
        raise HiltError(f"{where}: no [axes] table; a grid needs at least [axes] model = [...] and time = [...]")
    for key in axes_raw:
        if key not in AXES:
            raise HiltError(f"{where}: axes.{key}: unknown axis; choose model, preset, chips, gdc, time or a "
                            f"field of hilt.cim_sim.AnalogConfig ({', '.join(CONFIG_FIELDS)})")
    for key in ("model", "time"):
        if key not in axes_raw:
            raise HiltError(f"{where}: axes.{key} is missing: a grid needs at least [axes] model and time")
    if "chips" in axes_raw and "chips" in raw:
        raise HiltError(f"{where}: chips is given both as a setting and as axes.chips; keep one")

    models_raw = raw.get("models", {})
    if not isinstance(models_raw, dict):
        raise HiltError(f"{where}: models: expected tables [models.NAME] with spec and checkpoint")
    models = {}
    for name, entry in models_raw.items():
        if not isinstance(entry, dict):
            raise HiltError(f"{where}: models.{name}: expected a table with spec and checkpoint")
        for k in entry:
            if k not in ("spec", "checkpoint"):
                raise HiltError(f"{where}: models.{name}.{k}: unknown key; a model has spec and checkpoint")
        for k in ("spec", "checkpoint"):
            if k in entry and (not isinstance(entry[k], str) or not entry[k]):
                raise HiltError(f"{where}: models.{name}.{k}: expected a string, got {entry[k]!r}")
        models[name] = {"spec": entry.get("spec", name), "checkpoint": entry.get("checkpoint")}

    axes = {}
    for axis in AXES:
        if axis == "chips":
            values = axes_raw.get("chips", integer("chips", 1, DEFAULT_CHIPS))
        else:
            values = axes_raw.get(axis, DEFAULTS.get(axis))
        if values is None:
            continue
        values = values if isinstance(values, list) else [values]
        if not values:
            raise HiltError(f"{where}: axes.{axis} is empty; give at least one value")
        axes[axis] = _check_axis(where, axis, values, models)
    grid = Grid(path, seed, data, images, batch_size, axes,
                {m: models.get(m, {"spec": m, "checkpoint": None}) for m in axes["model"]}, tuple(models), language)
    for name in axes["model"]:
        if grid.is_language_model(name) and grid.models[name]["checkpoint"] is not None:
            raise HiltError(f"{where}: models.{name}: a language model's weights are its file or folder "
                            "(spec); it takes no checkpoint")
    for values in _combinations(grid, GROUP_AXES):  # every configuration must be one the simulator takes
        try:
            grid.config(values)  # AnalogConfig checks itself whole on construction
        except HiltError as e:
            raise HiltError(f"{where}: axes.device: {e}") from None
    return grid


def _check_axis(where: str, axis: str, values: list, models: dict) -> list:
    def bad(expected, v):
        raise HiltError(f"{where}: axes.{axis}: expected {expected}, got {v!r}")

    out = []
    if axis == "model":
        for v in values:
            if not isinstance(v, str) or not v:
                bad("model names (built-in workloads or names from [models])", v)
        out = list(values)
    elif axis == "preset":
        for v in values:
            if not isinstance(v, str):
                bad("preset names", v)
            try:
                preset(v)
            except HiltError as e:
                raise HiltError(f"{where}: axes.preset: {e}") from None
        out = list(values)
    elif axis == "gdc":
        for v in values:
            if v not in GDC_MODES:
                raise HiltError(f"{where}: axes.gdc: unknown drift compensation {v!r}; choose one of "
                                f"{', '.join(GDC_MODES)}")
        out = list(values)
    elif axis == "chips":
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad("a positive number of chips", v)
        out = list(values)
    elif axis == "time":
        seen = {}
        for v in values:
            if isinstance(v, bool) or not isinstance(v, str | int | float):
                bad("times such as '1s', '1d', '1y' or seconds", v)
            try:
                seconds = parse_time(v)
            except HiltError as e:
                raise HiltError(f"{where}: axes.time: {e}") from None
            if not math.isfinite(seconds):
                bad("a finite time", v)
            if seconds in seen:
                raise HiltError(f"{where}: axes.time: {seen[seconds]!r} and {str(v)!r} are the same time")
            seen[seconds] = str(v)
            out.append(str(v))
        return out
    else:  # an AnalogConfig field: the type of its default decides what it takes
        f = next(f for f in dataclasses.fields(AnalogConfig) if f.name == axis)
        optional = "None" in str(f.type)
        kind = type(f.default)
        for v in values:
            if optional and v == _OFF:
                out.append(None)
                continue
            ok = (isinstance(v, bool) if kind is bool else isinstance(v, str) if kind is str
                  else isinstance(v, int) and not isinstance(v, bool) if kind is int
                  else isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v))
            expected = {bool: "true or false", str: "strings", int: "integers", float: "numbers"}[kind]
            if kind in (int, float):  # the field's own range (cim_sim.config.FIELD_RANGES)
                lo, hi, open_low = FIELD_RANGES[axis]
                ok = ok and (v > lo if open_low else v >= lo) and (hi is None or v <= hi)
                expected += f" {'>' if open_low else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
            if not ok:
                bad(expected + (f" or {_OFF!r}" if optional else ""), v)
            out.append(float(v) if kind is float else v)
    if len({canonical(v) for v in out}) != len(out):
        raise HiltError(f"{where}: axes.{axis}: a value is given twice")
    return out


def _combinations(grid: Grid, axes) -> list[dict]:
    names = [a for a in axes if a in grid.axes]
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(grid.axes[a] for a in names))]


# AnalogConfig fields added after the seed rules were fixed: left out of a cell's seed at their
# defaults, so that a grid that does not set them keeps its seeds (and its rows)
_LATER_FIELDS = ("weight_mapping", "clip_std", "clip_percentile", "input_range", "input_percentile", "smoothing",
                 "gdc_before_adc", "devices_per_weight")


def seed_fields(config: AnalogConfig) -> dict:
    default = AnalogConfig()
    return {k: v for k, v in dataclasses.asdict(config).items()
            if k not in _LATER_FIELDS or v != getattr(default, k)}


def cells_of(grid: Grid) -> tuple[list[Cell], list[Group]]:
    """Every cell in grid order, and the groups (model, configuration, chips) they fall in."""
    cells, groups, by_key = [], [], {}
    for values in _combinations(grid, AXES):
        config = grid.config(values)
        seed = derive(FORMAT, grid.seed, values["model"], seed_fields(config))
        key = (values["model"], canonical(dataclasses.asdict(config)), values["chips"])
        if key not in by_key:
            by_key[key] = Group(len(groups), values["model"], config, values["chips"], seed)
            groups.append(by_key[key])
        group = by_key[key]
        cell = Cell(len(cells), values, parse_time(values["time"]), group.index, seed)
        cells.append(cell)
        group.cells.append(cell)
    return cells, groups
