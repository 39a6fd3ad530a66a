"""The hilt on-disk format, and quantizing a whole checkpoint into it.

A quantized checkpoint is a folder (docs/format.md): ``hilt.json``, the header (format and tool
versions, settings, per tensor its kind, format, shape, dtype, shard and errors); the shards in Hugging
Face's layout (``model.safetensors``, or ``model-00001-of-00003.safetensors``... with their index), where
a quantized ``MODULE.weight`` is QuantLinear's buffers ``MODULE.codes``, ``.codebook``, ``.scales``
(``.offsets``) and other tensors are as they were; from a Hugging Face folder, its other files and a
config whose "quantization_config" transformers loads (hilt.quant.hf_quantizer).

Writing streams tensor by tensor, so memory follows the few largest tensors in flight (two jobs ahead
of the one being written), not the model: each tensor's bytes go to disk as they come, and a table as
large as a shard is copied file to file. Everything is written under ``DST.partial/``, each shard to a
temporary name renamed when complete; the folder becomes DST only when the header is written. An
interrupted run leaves ``DST.partial/`` (never a half-written DST) and ``resume=True`` continues it,
giving the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from safetensors import SafetensorError, safe_open

from hilt import __version__
from hilt.atomic import SafetensorsWriter, check_parent, move_into_place, write_json
from hilt.errors import HiltError, one_line
from hilt.progress import LOG, Progress
from hilt.quant import hf_folder
from hilt.quant.formats import fitted_methods
from hilt.quant.quantize import (
    QuantConfig, check_quantizable, expected_bits_per_weight, quantize_measured, relative_error,
)
from hilt.quant.qweight import QuantizedWeight
from hilt.quant.sources import SAFETENSORS_DTYPES, Source, open_source
from hilt.quant.targets import embedding_config, embedding_tables, embeddings_record, select_targets

if TYPE_CHECKING:
    from hilt.quant.compensate import Compensator

FORMAT_NAME = "hilt-quantized"
FORMAT_VERSION = 2  # 2: parts named after the module (MODULE.codes), Hugging Face shard names
TOOL_VERSION = __version__  # the installed package's, as `hilt --version` prints
HEADER = "hilt.json"
PROGRESS = "progress.json"
SCRATCH = "next-shard.tmp"  # the bytes of the shard being filled, until it is written
PARTS = ("codes", "codebook", "scales", "offsets")

__all__ = ["quantize_checkpoint", "plan_checkpoint", "Plan", "Written", "load_checkpoint", "read_header",
           "open_source"]


def _check_destination(dst: Path, overwrite: bool, resume: bool) -> Path:
    partial = dst.with_name(dst.name + ".partial")
    check_parent(dst)
    if dst.exists():
        if not overwrite:
            raise HiltError(f"{dst}: already exists; pass --overwrite to replace it")
        if not (dst.is_dir() and (dst / HEADER).exists()):
            raise HiltError(f"{dst}: exists and is not a hilt checkpoint; refusing to replace it")
    if partial.exists() and not resume and not overwrite:
        raise HiltError(f"{partial}: an interrupted run is there; pass --resume to continue it or --overwrite to start over")
    return partial


def part_key(name: str, part: str, version: int = FORMAT_VERSION) -> str:
    """The shard key of one part of the quantized tensor ``name``. From version 2 the parts of a
    ``MODULE.weight`` are named after the module (``MODULE.codes``: QuantLinear's buffers, so
    transformers loads them as they are); version 1 named them after the tensor."""
    if version >= 2 and name.endswith(".weight"):
        name = name.removesuffix(".weight")
    return f"{name}.{part}"


def _tensor_parts(name: str, q: QuantizedWeight) -> dict[str, torch.Tensor]:
    return {part_key(name, part): t.contiguous() for part, t in q.packed.tensors().items()}


def check_unquantized(source) -> None:
    """Refuse a source that holds a quantized checkpoint's parts (codes with their scales)."""
    names = set(source.names())
    packed = next((n for n in sorted(names) if n.endswith(".codes") and f"{n[:-6]}.scales" in names), None)
    if packed is not None:
        raise HiltError(f"{source.path}: holds quantized codes and scales ({packed}), as a hilt checkpoint does; "
                        "quantize the model it came from")


@dataclass
class Plan:
    """What a quantize run will do, checked before anything is written: the tensors to quantize in
    the source's order, each one's format, and how many an interrupted run already finished."""

    source: str
    targets: list[str]
    formats: dict[str, QuantConfig]
    shapes: dict[str, tuple[int, ...]]
    kept: int  # tensors copied as they are
    source_bytes: int
    resumed: int = 0  # quantized tensors DST.partial holds (resume=True)

    def rows(self) -> list[dict]:
        """Per target: name, shape, and the bits per weight its format will take."""
        return [{"name": n, "shape": list(self.shapes[n]),
                 "bits_per_weight": round(expected_bits_per_weight(self.shapes[n], self.formats[n]), 4)}
                for n in self.targets]


@dataclass
class Written:
    """What a quantize run wrote: the header of DST/hilt.json, the plan it followed, the shards' bytes,
    and where this run's time went (read, quantize, error statistics, write; compensation's own split)."""

    header: dict
    plan: Plan
    bytes: int
    seconds: dict[str, float]
    compensation_seconds: dict[str, float] = field(default_factory=dict)


def _check_request(src, dst, config: QuantConfig, importance, compensate, formats, overwrite: bool,
                   resume: bool) -> tuple[Path | None, dict | None, str | None]:
    """The checks that need no tensor: flag combinations, an already quantized source, the destination.
    Returns DST.partial (None without a destination), the model folder's config (None if not one) and
    a warning for a result from_pretrained will not load (None if it will), said once the plan holds."""
    if importance is not None and not config.format.fitted:
        raise HiltError(f"--importance applies to --method {fitted_methods()} only")
    if importance is not None and compensate is not None:
        raise HiltError("--importance and --compensate exclude each other: compensation weighs columns by its own calibration")
    if formats and (importance is not None or compensate is not None):
        raise HiltError("per-tensor formats (--budget) exclude --importance and --compensate: the formats were "
                        "chosen by the error of plain rounding")
    model_config, warning = None, None
    if hf_folder.is_hf_folder(src):
        model_config = hf_folder.read_config(src)
        if model_config.get("quantization_config"):
            method = model_config["quantization_config"].get("quant_method", "unknown")
            raise HiltError(f"{Path(src) / hf_folder.CONFIG}: the model is already quantized ({method}); "
                            "quantize its unquantized folder")
        unknown = hf_folder.unknown_model_type(model_config)
        if unknown:
            warning = (f"{Path(src) / hf_folder.CONFIG}: {unknown}; the quantized folder will not load with "
                       "from_pretrained (hilt's own loaders still read it)")
    elif Path(src).is_dir():
        warning = (f"{src}: no config.json beside the weights, so the output is a hilt checkpoint that "
                   "from_pretrained cannot load (hilt's own loaders read it)")
    if (Path(src) / HEADER).is_file():
        raise HiltError(f"{src}: already a hilt quantized checkpoint; quantize the model it came from")
    partial = None if dst is None else _check_destination(Path(dst), overwrite, resume)
    return partial, model_config, warning


def _plan(source: Source, src, config: QuantConfig, only, ignore, formats, embeddings, weights, importance,
          partial: Path | None, resume: bool) -> tuple[Plan, dict[str, QuantConfig]]:
    """The plan, and the targets whose format is not ``config`` (--budget's, the embeddings')."""
    check_unquantized(source)
    targets = set(select_targets(source, only, ignore))
    if not targets:
        raise HiltError(f"{src}: no tensor selected for quantization (check --only/--ignore)")
    unknown = sorted(set(formats) - targets)
    if unknown:
        raise HiltError(f"{src}: a format is given for '{unknown[0]}', which is not among the tensors to quantize")
    per_tensor = dict(formats)
    if embeddings is not None:
        tables = embedding_tables(source, ignore)
        if not tables:
            raise HiltError(f"{src}: --embeddings: no embedding table or output head found")
        per_tensor.update({n: embedding_config(embeddings, source.shape(n)) for n in tables})
        targets |= set(tables)
    ordered = [n for n in source.names() if n in targets]
    shapes = {n: tuple(source.shape(n)) for n in ordered}
    for name in ordered:
        check_quantizable(name, shapes[name], per_tensor.get(name, config))
    if weights and not targets & set(weights):
        raise HiltError(f"{importance}: lists none of the tensors to quantize (made for another model?)")
    resumed = 0
    if resume and partial is not None and (partial / PROGRESS).exists():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            state = json.loads((partial / PROGRESS).read_text())
            resumed = sum(e["kind"] == "quantized" for e in state["tensors"].values())
    plan = Plan(str(src), ordered, {n: per_tensor.get(n, config) for n in ordered}, shapes,
                len(source.names()) - len(ordered), source.nbytes(), resumed)
    return plan, per_tensor


def plan_checkpoint(src, dst=None, config: QuantConfig | None = None, *, only: str | None = None,
                    ignore: str | None = None, overwrite: bool = False, resume: bool = False, importance=None,
                    formats: dict[str, QuantConfig] | None = None, embeddings: int | QuantConfig | None = None) -> Plan:
    """The plan :func:`quantize_checkpoint` would follow with these arguments, with every check it
    makes before writing (the destination's too, given one); reads no tensor data."""
    config = config or QuantConfig()
    formats = formats or {}
    partial, _, warning = _check_request(src, dst, config, importance, None, formats, overwrite, resume)
    weights = {} if importance is None else load_importance(importance)
    with open_source(src) as source:
        plan = _plan(source, src, config, only, ignore, formats, embeddings, weights, importance, partial, resume)[0]
    if warning:
        LOG.warning(warning)
    return plan


def quantize_checkpoint(
    src,
    dst,
    config: QuantConfig,
    *,
    only: str | None = None,
    ignore: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
    shard_bytes: int = 256 << 20,
    importance=None,
    codebooks: dict[str, torch.Tensor] | None = None,
    compensate: Callable[[list[str]], "Compensator"] | None = None,
    formats: dict[str, QuantConfig] | None = None,
    mixed: dict | None = None,
    embeddings: int | QuantConfig | None = None,
    dense_dtype: torch.dtype | None = None,
    on_tensor: Callable[[dict], None] | None = None,
    progress: bool = False,
    threads: int | None = None,
    executor=None,
) -> Written:
    """Quantize the selected tensors of ``src`` into a hilt checkpoint at ``dst``.

    ``importance``: a safetensors file (from `hilt calibrate`) mapping tensor names to per-input-column
    importance; k-means then weights each weight's error by it. Tensors it does not list are fitted
    unweighted. ``codebooks``: fixed k-means levels per tensor name (a QAT export), used instead of fitting. ``compensate``: makes a
    :class:`hilt.quant.compensate.Compensator` over the same model from the names of the tensors to
    quantize (called once the destination and the targets are checked); the tensors it covers are
    quantized with error compensation, the others rounded as without it. ``formats``: a format per
    tensor name (mixed precision, from hilt.quant.allocate) replacing ``config`` for the tensors it
    names; ``mixed`` (how they were chosen) is recorded in the header under ``"mixed"``.
    ``embeddings``: also quantize the embeddings and output heads, to symmetric integers of that many
    bits with one scale per row, or to a QuantConfig. ``dense_dtype``: the dtype of every floating tensor left unquantized; by
    default each keeps the dtype it is stored in, and a GGUF block type (already quantized) becomes bfloat16.

    From a Hugging Face model folder (with a config.json) the output is one too: its config with a
    ``quantization_config`` (hilt.quant.hf_folder) and its tokenizer and generation files.

    Returns what was written (:class:`Written`; its ``header`` is DST/hilt.json). ``on_tensor`` is
    called with each tensor's entry (name, kind, bits_per_weight, rel_error, ...); ``progress``
    shows a bar on a terminal, a line per quantized tensor on the ``hilt`` logger otherwise.

    ``threads``: tensors quantized at once on threads of this process (default: one per CPU, at most 2;
    torch's own threads work inside each); ``executor``: a pool with ``submit`` that runs the jobs
    instead (hilt/tasks/quantize_ray.py's Ray cluster). The bytes written are the same either way.
    """
    dst = Path(dst)
    formats = formats or {}
    partial, model_config, warning = _check_request(src, dst, config, importance, compensate, formats, overwrite,
                                                    resume)
    weights = {} if importance is None else load_importance(importance)
    source = open_source(src)
    try:
        plan, per_tensor = _plan(source, src, config, only, ignore, formats, embeddings, weights, importance,
                                 partial, resume)
        if warning:
            LOG.warning(warning)
        compensator = None if compensate is None else compensate([n for n in plan.targets if n not in per_tensor])
        settings = {
            "config": asdict(config),
            "source": {"path": str(Path(src).resolve()), "format": source.format},  # found from any folder later
            "only": only,
            "ignore": ignore,
            "importance": None if importance is None else str(importance),
            "compensation": None if compensator is None else compensator.settings,
            "shard_bytes": shard_bytes,
            "dense_dtype": None if dense_dtype is None else str(dense_dtype).removeprefix("torch."),
            "embeddings": embeddings_record(embeddings),
        }
        if formats:  # only mixed checkpoints carry the key, so uniform headers stay as they were
            settings["mixed"] = {**(mixed or {}), "formats": {n: asdict(c) for n, c in sorted(formats.items())}}
        try:
            state = _start_or_resume(partial, settings, resume)
        except OSError as e:
            raise HiltError(f"{dst}: cannot write there ({e.strerror})") from None
        seconds = dict.fromkeys(("read", "quantize", "fit", "pack", "error", "write"), 0.0)
        start = time.perf_counter()
        threads = threads or min(2, os.cpu_count() or 1)
        pool = None if executor is not None or threads < 2 else ThreadPoolExecutor(threads, "hilt-quantize")
        try:
            with Progress(len(plan.targets), "quantize", "tensor", initial=plan.resumed, echo=True,
                          enabled=progress) as bar, pool or contextlib.nullcontext():
                _stream(source, set(plan.targets), weights, codebooks or {}, compensator, config, per_tensor,
                        dense_dtype, partial, state, shard_bytes, on_tensor, bar, seconds, executor or pool)
            t0 = time.perf_counter()
            _name_shards(partial, state)
            header = {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "tool_version": TOOL_VERSION,
                **settings,
                "shards": state["shards"],
                "tensors": state["tensors"],
                "totals": _totals(state["tensors"]),
            }
            if model_config is not None:
                hf_folder.copy_companions(Path(src), partial)
                write_json(partial / hf_folder.CONFIG,
                           {**model_config, "quantization_config": hf_folder.quantization_config(header)})
            write_json(partial / HEADER, header, sort_keys=True)
            (partial / PROGRESS).unlink()
            size = sum((partial / s).stat().st_size for s in header["shards"])
            move_into_place(partial, dst)
            seconds["write"] += time.perf_counter() - t0
            seconds["total"] = time.perf_counter() - start
            return Written(header, plan, size, {k: round(v, 3) for k, v in seconds.items()},
                           {} if compensator is None else {k: round(v, 3) for k, v in compensator.seconds.items()})
        except KeyboardInterrupt:
            raise  # keep DST.partial for --resume
        except BaseException as e:
            shutil.rmtree(partial, ignore_errors=True)  # no half-written output for a failed run
            if isinstance(e, OSError):
                raise HiltError(f"{dst}: cannot write there ({e.strerror})") from None
            raise
    finally:
        source.close()


def _start_or_resume(partial: Path, settings: dict, resume: bool) -> dict:
    if resume and (partial / PROGRESS).exists():
        (partial / SCRATCH).unlink(missing_ok=True)  # the unfinished shard of the interrupted run
        state = json.loads((partial / PROGRESS).read_text())
        if state["settings"] != json.loads(json.dumps(settings)):
            raise HiltError(f"{partial}: the interrupted run used other settings; rerun them or pass --overwrite")
        return state
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    state = {"settings": settings, "shards": [], "tensors": {}}
    write_json(partial / PROGRESS, state, sort_keys=True)
    return state


def quantize_one(source, name: str, config: QuantConfig, importance, codebook) -> tuple[dict, dict, dict]:
    """Read and quantize the tensor ``name`` of ``source`` (a Source, or a path opened here): its shard
    parts, the fields of its header entry that depend on the values, and the seconds it took. One job
    of the writer, run on a thread of this process or as a Ray task (hilt/tasks/quantize_ray.py)."""
    if not isinstance(source, Source):
        source = _opened(str(source), os.stat(source).st_mtime_ns)
    t0 = time.perf_counter()
    w = source.get_stored(name)  # bf16 as stored: half the memory of float32, widened band by band
    read = time.perf_counter() - t0
    q, error, seconds = quantize_measured(w, config, name=name, importance=importance, codebook=codebook, dtype=torch.float32)
    fields = {"method": q.method, "bits": q.bits, "block_size": q.block_size, "codebook": q.codebook_scope,
              "shape": list(q.shape), "dtype": str(q.dtype).removeprefix("torch."),
              "bits_per_weight": round(q.bits_per_weight, 6), "rel_error": round(error, 6)}
    return _tensor_parts(name, q), fields, {"read": read, **seconds}


@functools.lru_cache(maxsize=1)
def _opened(path: str, mtime_ns: int) -> Source:
    return open_source(path)  # kept open for the next job of the same run (a changed file is opened again)


def _stream(source, targets, importance, codebooks, compensator, config, formats, dense_dtype, partial, state,
            shard_bytes, on_tensor, bar: Progress, seconds: dict, executor=None):
    """Every tensor not yet written, in file order, into shards of ``shard_bytes``. Quantized tensors are
    jobs (:func:`quantize_one`) on ``executor`` (a concurrent.futures-like pool; None: this thread), a
    few ahead of the one being written, so reading, fitting and writing overlap; their results are
    taken in file order, so the shards are the same whatever ran them."""
    done = set(state["tensors"])
    todo = [n for n in source.names() if n not in done]
    shard = SafetensorsWriter(partial / SCRATCH)  # tensors go to disk as they come: no shard in memory
    entries: dict[str, dict] = {}
    requantized = sorted({source.stored_type(n) for n in targets if source.is_block_quantized(n)})
    jobs = [n for n in todo if n in targets and not (compensator is not None and compensator.covers(n))]
    ahead = 0 if executor is None else getattr(executor, "jobs_ahead", 2)
    pending: dict[str, object] = {}

    def submit_until():  # keep ``ahead`` jobs in flight: memory holds that many tensors, not the model
        while jobs and len(pending) < ahead:
            n = jobs.pop(0)
            pending[n] = executor.submit(quantize_one, source, n, formats.get(n, config), importance.get(n),
                                         codebooks.get(n))

    for name in todo:
        submit_until()
        t0 = time.perf_counter()
        if name in targets:
            extra = {}
            if compensator is not None and compensator.covers(name):
                w = source.get(name)
                t1 = time.perf_counter()
                seconds["read"] += t1 - t0

                def written(names):  # a resumed run: the tensors already in finished shards
                    return _read_tensors(partial, state["tensors"], [n for n in names if n in state["tensors"]])
                q = compensator.quantized(name, known=written)
                extra = {"compensated": compensator.stats[name]["compensated"],
                         **{k: round(v, 6) for k, v in compensator.stats[name].items() if k.startswith("output")}}
                parts = _tensor_parts(name, q)
                t2 = time.perf_counter()
                seconds["quantize"] += t2 - t1
                fields = {"method": q.method, "bits": q.bits, "block_size": q.block_size,
                          "codebook": q.codebook_scope, "shape": list(q.shape),
                          "dtype": str(q.dtype).removeprefix("torch."), "bits_per_weight": round(q.bits_per_weight, 6),
                          "rel_error": round(relative_error(w, q), 6)}
                seconds["error"] += time.perf_counter() - t2
                del w
            else:
                job = pending.pop(name, None)
                if job is None:
                    parts, fields, spent = quantize_one(source, name, formats.get(name, config), importance.get(name),
                                                        codebooks.get(name))
                else:
                    parts, fields, spent = job.result()
                for k, v in spent.items():
                    seconds[k] = seconds.get(k, 0.0) + v
                seconds["quantize"] += spent["fit"] + spent["pack"]
            if requantized and source.is_block_quantized(name):  # once, when the first such tensor has been read
                LOG.warning(f"{source.path}: its weights are already quantized ({', '.join(requantized)}); they are "
                            "dequantized and quantized again, so their errors add up")
                requantized = None
            entry = {"kind": "quantized", "importance_weighted": name in importance, **fields,
                     "stored_type": source.stored_type(name), **extra}
            entry = {k: entry[k] for k in ENTRY_ORDER if k in entry} | entry
        else:
            stored, kind = source.stored_bytes(name) if dense_dtype is None else None, source.stored_type(name)
            if stored is not None and stored[2] >= shard_bytes:  # a table as large as a shard (8B embeddings:
                # 1 GB) is a shard of its own, copied file to file: never in memory beside the jobs in flight
                if len(shard):
                    _flush(partial, state, entries, shard)
                entry = {"kind": "dense", "shape": list(source.shape(name)), "stored_type": kind,
                         "dtype": str(SAFETENSORS_DTYPES[kind]).removeprefix("torch.")}
                shard.add_stored(name, SAFETENSORS_DTYPES[kind], entry["shape"], *stored)
                _flush(partial, state, {name: entry}, shard)
                seconds["write"] += time.perf_counter() - t0
                if on_tensor is not None:
                    on_tensor({"name": name, **entry})
                continue
            t = source.get_stored(name)
            seconds["read"] += time.perf_counter() - t0
            if t.is_floating_point() and (dense_dtype is not None or source.is_block_quantized(name)):
                t = t.to(dense_dtype or torch.bfloat16)
            parts = {name: t.contiguous()}
            entry = {"kind": "dense", "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                     "stored_type": source.stored_type(name)}
        for part, t in parts.items():
            shard.add(part, t)
        entries[name] = entry
        if on_tensor is not None:
            on_tensor({"name": name, **entry})
        if entry["kind"] == "quantized":
            bar.done(name, _detail(entry))
        if shard.nbytes >= shard_bytes:
            t0 = time.perf_counter()
            submit_until()  # the next jobs run while this shard is written
            _flush(partial, state, entries, shard)
            seconds["write"] += time.perf_counter() - t0
    if len(shard):
        t0 = time.perf_counter()
        _flush(partial, state, entries, shard)
        seconds["write"] += time.perf_counter() - t0


# the order of a quantized tensor's header entry (the progress file keeps it; hilt.json sorts its keys)
ENTRY_ORDER = ("kind", "importance_weighted", "method", "bits", "block_size", "codebook", "shape", "dtype",
               "stored_type", "bits_per_weight", "rel_error")


def _detail(entry: dict) -> str:
    detail = f"{entry['bits_per_weight']:.3f} bits/weight, rel. error {entry['rel_error']:.4f}"
    if "output_rel_error" in entry:  # compensated: the error that counts is the layer output's
        detail += (f", output error {entry['output_rel_error']:.4f} "
                   f"(rounding alone {entry['output_rel_error_rounded']:.4f})")
    return detail


def _flush(partial: Path, state: dict, entries: dict, shard: SafetensorsWriter) -> None:
    """Write the shard being filled (temporary name, then rename), then record the tensors of ``entries``
    as done and empty it."""
    name = f"shard-{len(state['shards']) + 1:05d}.safetensors"  # named for good once the count is known
    shard.finish(partial / name, metadata={"format": "pt"})  # one key: map order is not stable
    for e in entries.values():
        e["shard"] = name
    state["shards"].append(name)
    state["tensors"].update(entries)
    entries.clear()
    write_json(partial / PROGRESS, state, sort_keys=True)


def _name_shards(partial: Path, state: dict) -> None:
    """Give the finished shards Hugging Face's names and, for more than one, write the index."""
    final = hf_folder.shard_names(len(state["shards"]))
    rename = dict(zip(state["shards"], final))
    weight_map, total = {}, 0
    for old, new in rename.items():
        with safe_open(str(partial / old), framework="pt") as f:
            weight_map.update({k: new for k in f.keys()})
        total += (partial / old).stat().st_size
        os.replace(partial / old, partial / new)
    state["shards"] = final
    for e in state["tensors"].values():
        e["shard"] = rename[e["shard"]]
    if len(final) > 1:
        hf_folder.write_index(partial, weight_map, total)
    write_json(partial / PROGRESS, state, sort_keys=True)  # a resumed run finds the shards by their new names


def _totals(tensors: dict) -> dict:
    q = [t for t in tensors.values() if t["kind"] == "quantized"]
    n_q = sum(t["shape"][0] * t["shape"][1] for t in q)
    bits_q = sum(t["bits_per_weight"] * t["shape"][0] * t["shape"][1] for t in q)
    return {
        "tensors": len(tensors),
        "quantized_tensors": len(q),
        "quantized_weights": n_q,
        "bits_per_weight": round(bits_q / n_q, 6) if n_q else None,
        "rel_error_mean": (round(sum(t["rel_error"] for t in q) / len(q), 6)
                           if q and all(t.get("rel_error") is not None for t in q) else None),
    }


def load_importance(path) -> dict[str, torch.Tensor]:
    """Per-tensor importance vectors from a safetensors file (never a pickle)."""
    path = Path(path)
    if not path.is_file():
        raise HiltError(f"{path}: no such importance file")
    source = open_source(path)
    try:
        out = {}
        for name in source.names():
            t = source.get(name)
            if t.ndim != 1 or not torch.isfinite(t).all() or bool((t < 0).any()):
                raise HiltError(f"{path}: importance '{name}' must be a finite, non-negative 1-D tensor")
            out[name] = t
        return out
    finally:
        source.close()


def read_header(dst) -> dict:
    """The header of a hilt checkpoint, validated."""
    dst = Path(dst)
    path = dst / HEADER
    if not dst.exists():
        raise HiltError(f"{dst}: no such file or directory")
    if not path.exists():
        header = _header_from_model_config(dst)
        if header is None:
            raise HiltError(f"{dst}: not a hilt checkpoint (no {HEADER})")
        return header
    try:
        header = json.loads(path.read_text())
    except ValueError as e:
        raise HiltError(f"{path}: corrupt header ({e})") from None
    if header.get("format") != FORMAT_NAME:
        raise HiltError(f"{path}: not a {FORMAT_NAME} header")
    if header.get("format_version", 0) > FORMAT_VERSION:
        raise HiltError(f"{path}: format version {header['format_version']} is newer than this hilt reads ({FORMAT_VERSION})")
    return header


def _header_from_model_config(dst: Path) -> dict | None:
    """The header of a folder that transformers' ``save_pretrained`` wrote from a model loaded from a
    hilt folder (its config.json's quantization_config, no hilt.json), rebuilt from that config and
    the shards: what the tensors are, not how they were made. None for any other folder."""
    if not hf_folder.is_hf_folder(dst):
        return None
    qc = hf_folder.read_config(dst).get("quantization_config") or {}
    if qc.get("quant_method") != hf_folder.QUANT_METHOD:
        return None
    where = dst / hf_folder.CONFIG
    if qc.get("format_version", 0) > FORMAT_VERSION:
        raise HiltError(f"{where}: format version {qc['format_version']} is newer than this hilt reads ({FORMAT_VERSION})")
    index = dst / hf_folder.INDEX
    try:
        shards = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
                  else sorted(p.name for p in dst.glob("*.safetensors")))
        modules = qc["modules"]
        tensors = {}
        for shard in shards:
            with safe_open(str(dst / shard), framework="pt") as f:
                slices = {k: f.get_slice(k) for k in f.keys()}
            info = {k: (list(sl.get_shape()), SAFETENSORS_DTYPES[sl.get_dtype()]) for k, sl in slices.items()}
            parts = set()
            for module, fmt in modules.items():
                if f"{module}.codes" not in info:
                    continue
                n, blocks = info[f"{module}.scales"][0]
                keys = [k for k in (f"{module}.{p}" for p in PARTS) if k in info]
                parts.update(keys)
                stored = sum(math.prod(info[k][0]) * info[k][1].itemsize for k in keys)
                tensors[f"{module}.weight"] = {
                    "kind": "quantized", "method": fmt["method"], "bits": fmt["bits"], "block_size": fmt["block_size"],
                    "codebook": fmt["codebook"], "shape": [n, blocks * fmt["block_size"]], "dtype": "float32",
                    "bits_per_weight": round(stored * 8 / (n * blocks * fmt["block_size"]), 6), "rel_error": None,
                    "shard": shard}
            for k in sorted(set(info) - parts):
                tensors[k] = {"kind": "dense", "shape": info[k][0], "dtype": str(info[k][1]).removeprefix("torch."),
                              "shard": shard}
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise HiltError(f"{where}: its quantization_config does not fit the shards ({e})") from None
    config = {k: qc.get(k) for k in ("method", "bits", "block_size", "codebook")}
    return {"format": FORMAT_NAME, "format_version": qc.get("format_version", FORMAT_VERSION), "tool_version": None,
            "config": config, "source": {"path": str(dst), "format": "transformers save_pretrained"},
            "shards": shards, "tensors": tensors, "totals": _totals(tensors)}


def load_checkpoint(dst, names: Iterable[str] | None = None) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor of a hilt checkpoint: QuantizedWeight for quantized ones, tensors otherwise."""
    dst = Path(dst)
    header = read_header(dst)
    wanted = list(header["tensors"]) if names is None else list(names)
    missing = [n for n in wanted if n not in header["tensors"]]
    if missing:
        raise HiltError(f"{dst}: no tensor '{missing[0]}'")
    return _read_tensors(dst, header["tensors"], wanted, header["format_version"])


def _read_tensors(folder: Path, entries: dict, names: list[str],
                  version: int = FORMAT_VERSION) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The tensors ``names`` of a checkpoint folder whose header entries are ``entries``, in that order."""
    by_shard: dict[str, list[str]] = {}
    for name in names:
        by_shard.setdefault(entries[name]["shard"], []).append(name)
    loaded: dict[str, torch.Tensor | QuantizedWeight] = {}
    for shard, shard_names in by_shard.items():
        with open_shard(folder / shard) as f:
            keys = set(f.keys())
            for name in shard_names:
                e = entries[name]
                if e["kind"] == "dense":
                    loaded[name] = f.get_tensor(name)
                    continue
                keyed = {p: part_key(name, p, version) for p in PARTS}
                parts = {p: f.get_tensor(k) if k in keys else None for p, k in keyed.items()}
                loaded[name] = QuantizedWeight(
                    parts["codes"], parts["codebook"], parts["scales"], parts["offsets"],
                    tuple(e["shape"]), getattr(torch, e["dtype"]), e["bits"], e["block_size"], e["method"],
                )
    return {name: loaded[name] for name in names}


@contextlib.contextmanager
def open_shard(path: Path):
    """A checkpoint shard opened for reading; one cut short or damaged since it was written is one
    HiltError naming it (safetensors checks the file's length against its header on opening)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (OSError, SafetensorError) as e:
        raise HiltError(f"{path}: not a readable safetensors file ({one_line(e)})") from None
