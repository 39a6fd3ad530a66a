"""`hilt hwa MODEL OUT --method noise|dwp`: fine-tune a language model for a CIM chip.

The digital model is distilled into a copy of itself that is trained through noisy reads of the
chip's devices (cim_sim.training): every Linear the chip would hold (those `convert_to_analog`
puts on arrays) is replaced, in each forward, by one programmed-and-drifted read of the preset's
device at a time drawn log-uniformly between 1 s and 1 year (``times``: another range, e.g. the
late part of a deployment), mapped to conductances as the configuration says
(``weight_mapping``, ``devices_per_weight``); the gradient reaches the clean weights straight through the device.

- ``noise``: one read per step at noise level ``eta`` (1 = the published device);
- ``dwp``: ``copies`` reads per step at levels spread over [eta_min, eta_max], each token (or
  sentence) weighted by how much the reads disagree on it;
- ``afm``: the Analog Foundation Models recipe (cim_sim/afm.py, docs/references.md §12) for their chip: every
  chip Linear becomes an AfmLinear whose forward clips and rounds its input to a static range (calibrated on
  Macbeth, then learned), rounds its output to 8 bits and draws weight (and optionally output) noise each step;
  rows are clipped to ``clip_sigma`` std after each step. The learned ranges are written beside the model
  (``afm_input_ranges.json``), where `hilt drift --preset afm` reads them.

Causal LMs may train on text the model writes itself (``synthetic`` tokens, their recipe's data) instead of
Shakespeare.

Causal LMs minimise KL(digital || noisy) per token on Shakespeare's works but Hamlet; encoders
minimise 1 - cosine of the sentence embeddings on their sentences. The digital side (the teacher)
is the model itself unless ``teacher`` names another with the same tokenizer: continuing a tuned
model, its original keeps the target fixed (a continuation that distils from itself lets the target
drift a little further from the original with every run). With ``clip_std`` set in the
configuration, every output column is clipped to that many standard deviations after each step
(iterative weight clipping), as the mapping will clip it on the chip. Static input ranges and
smoothing scales are calibrated when the tuned model is put on a chip (`hilt drift --set ...`).

With ``periphery`` the reads also pass the chip's periphery (cim_sim.training.Periphery): each array's
DAC on the layer's input, the output noise and the ADC's rounding on its output, in the units the
configuration's mapping, smoothing and input ranges give them (calibrated once, on the model as it
starts), multiplied by the drift compensation unless the chip applies it ahead of the ADC.

Resumable like `hilt qat`: the state goes to ``OUT.hwa-state/`` every ``save_every`` steps, and
``resume`` draws the same batches and the same noise an uninterrupted run would. The output is the
model in its own format: a GGUF file (a Llama hilt runs itself) or a model folder (any model transformers runs,
a BERT), which `hilt drift
--model`, `hilt eval` and `hilt quantize` read.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
from pathlib import Path

import torch
from torch.func import functional_call

from hilt.errors import HiltError
from hilt.progress import LOG, Progress

HWA_METHODS = ("noise", "dwp", "afm")


def _source(spec: str) -> Path:
    """The file or folder of the model whose tokenizer and metadata the output keeps: any causal LM
    hilt.models.lm names, minilm or a BERT folder; any other model refused before it loads."""
    import json

    from hilt.models import bert, lm as causal

    if spec == "minilm":
        return bert.minilm_path()
    path = Path(spec)
    if spec in causal.BUILTIN or spec.endswith(".gguf") or causal.is_language_model(path):
        return causal.lm_source(spec).path
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        try:
            kind = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            raise HiltError(f"{config}: not a model config ({e})") from None
        if kind != "bert" or not (path / "tokenizer.json").is_file():
            raise HiltError(f"{path}: hilt hwa fine-tunes causal language models (smollm2, gemma3, a GGUF file or a "
                            "causal-LM folder) and encoders hilt runs itself (minilm or a BERT folder with "
                            f"tokenizer.json); model_type {kind!r} is neither")
        return path
    return path  # load_language_model says what is wrong with it


def _check_out(out: Path, as_file: bool | None, overwrite: bool) -> None:
    """``as_file``: the output is one GGUF file (a model on hilt's own Llama), else a model folder."""
    if out.exists() and not overwrite:
        raise HiltError(f"{out}: already exists; pass --overwrite to replace it")
    if as_file is True and out.is_dir():
        raise HiltError(f"{out}: is a folder; this model is written as one GGUF file")
    if as_file is False and out.exists() and not out.is_dir():
        raise HiltError(f"{out}: is a file; this model is written as a model folder")
    if not out.parent.is_dir():
        raise HiltError(f"{out.parent}: no such folder")


def _training_data(lm):
    """The training data: a long run of token ids (causal) or a list of sentences (encoder)."""
    from hilt.data.text import training_sentences, training_tokens

    if lm.kind == "causal":
        return torch.tensor(training_tokens(lm.encode, 400_000), dtype=torch.long)
    return training_sentences(4096)


def _teacher(lm, spec: str, student_spec: str):
    """The model ``spec`` loaded as the teacher of ``lm`` (the student, from ``student_spec``), refused unless
    it is the same kind of model, splits text into the same tokens and gives outputs of the same width."""
    from hilt.tasks.drift_lm import load_language_model

    teacher = load_language_model(spec)
    if teacher.kind != lm.kind:
        kinds = {"causal": "a causal LM", "encoder": "an encoder"}
        raise HiltError(f"--teacher {spec}: {kinds[teacher.kind]}, while {student_spec} is {kinds[lm.kind]}")
    probe = "Fair is foul, and foul is fair: hover through the fog and filthy air."
    same = (lm.encode(probe) == teacher.encode(probe) if lm.kind == "causal"
            else all(torch.equal(a, b) for a, b in zip(lm.encode([probe]), teacher.encode([probe]))))
    if not same:
        raise HiltError(f"--teacher {spec}: its tokenizer splits text differently from {student_spec}'s; the teacher "
                        "must share the student's tokens")
    with torch.no_grad():
        if lm.kind == "causal":
            ids = torch.tensor([lm.encode(probe)])
            widths = lm.logits(lm.model, ids).shape[-1], teacher.logits(teacher.model, ids).shape[-1]
        else:
            args = lm.encode([probe])
            widths = lm.hidden(lm.model, *args).shape[-1], teacher.hidden(teacher.model, *args).shape[-1]
    if widths[0] != widths[1]:
        raise HiltError(f"--teacher {spec}: its outputs have {widths[1]} features, {student_spec}'s {widths[0]}")
    return teacher


def _batch(lm, data, batch: int, context: int, gen: torch.Generator):
    """One step's inputs, drawn by ``gen``, and ``run(model, params=None, via=lm)``: their outputs by ``model``
    (with ``params`` in place of its own where given; ``via`` the LanguageModel that runs it), (N, C) for N
    tokens or sentences."""
    from hilt.models.bert import mean_pool

    if lm.kind == "causal":
        starts = torch.randint(len(data) - context, (batch,), generator=gen)
        args = (data[starts[:, None] + torch.arange(context)],)

        def run(model, params=None, via=lm):
            if params is None:
                return via.logits(model, *args).flatten(0, 1)
            out = functional_call(model, params, args)
            return getattr(out, "logits", out).flatten(0, 1)  # a transformers model's output holds its logits
        return run
    picks = torch.randint(len(data), (batch,), generator=gen).tolist()
    ids, mask = lm.encode([data[i] for i in picks])
    args = (ids, mask)

    def run(model, params=None, via=lm):
        hidden = via.hidden(model, *args) if params is None else functional_call(model, params, args)
        return mean_pool(hidden, mask)
    return run


def _digital_and_noisy(lm, teacher, student, data, batch: int, context: int, cfg, chip, times,
                       gen: torch.Generator, periphery=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's inputs through the teacher (a LanguageModel) and through cfg's noisy reads of the student on
    ``chip``'s devices (an AnalogConfig: its device and weight mapping), read at a time within ``times``, and
    through ``periphery`` (cim_sim.training.Periphery) where given: (K, N, C) noisy outputs and (N, C) digital
    ones, N tokens or sentences. On the afm chip (``chip`` an AfmConfig) the student is an AfmLinear model that
    draws its own noise: one output."""
    from hilt.cim_sim.afm import AfmConfig, afm_layers
    from hilt.cim_sim.training import analog_weights, perturb

    run = _batch(lm, data, batch, context, gen)
    with torch.no_grad():
        digital = run(teacher.model, via=teacher)
    if isinstance(chip, AfmConfig):
        for _, m in afm_layers(student):
            m.gen = gen
        return run(student).unsqueeze(0), digital
    params = dict(student.named_parameters())
    names = analog_weights(student)
    mapping = (chip.weight_mapping, chip.tile_size, times, chip.devices_per_weight)
    outs = []
    for eta in cfg.levels():
        reads = {n: perturb(params[n], eta, chip.device, gen, *mapping, return_gain=True) for n in names}
        hooks = [] if periphery is None else periphery.attach(student, params, gen, {n: g for n, (_, g) in reads.items()})
        try:
            outs.append(run(student, {n: w for n, (w, _) in reads.items()}))
        finally:
            for h in hooks:
                h.remove()
    return torch.stack(outs), digital


def synthetic_path(state_dir: Path) -> Path:
    return state_dir.with_name(state_dir.name + "-synthetic.safetensors")


def _synthetic_data(lm, model: str, tokens: int, context: int, seed: int, kept: Path,
                    progress: bool = True) -> torch.Tensor:
    """``tokens`` tokens the float model writes itself (in texts of ``context`` tokens, each led by its document
    start; their recipe's synthetic data at this scale), kept at ``kept`` until the run ends so that a resumed
    run trains on the same text."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hilt.atomic import replacing

    made_by = {"model": model, "tokens": str(tokens), "context": str(context), "seed": str(seed)}
    if kept.is_file():
        try:
            with safe_open(str(kept), "pt") as f:
                if f.metadata() == made_by:
                    return f.get_tensor("ids")
        except Exception:  # a damaged file is made again  # noqa: BLE001
            pass
    rows = -(-tokens // context)
    gen = torch.Generator().manual_seed(seed)
    bar = Progress(-(-rows // 16), "synthetic text", "batch of 16 texts", enabled=progress)
    texts = []
    for k in range(0, rows, 16):
        texts.append(lm.causal.sample(min(16, rows - k), context, gen))
        bar.done(f"{min(k + 16, rows)} texts", f"{sum(t.numel() for t in texts)} tokens written by {lm.name}")
    bar.close()
    ids = torch.cat(texts).flatten()[:tokens].contiguous()
    with replacing(kept, ".partial") as tmp:
        save_file({"ids": ids}, str(tmp), metadata=made_by)
    return ids


def tune(model: str, out, method: str = "noise", preset_name: str | None = None, overrides: dict | None = None,
         eta: float = 1.0, eta_min: float = 0.5, eta_max: float = 1.5, copies: int = 2, weighting: str = "js",
         steps: int = 60, lr: float = 2e-5, batch: int = 4, context: int = 128, save_every: int = 10, seed: int = 0,
         resume: bool = False, overwrite: bool = False, progress: bool = True, times: str = "1s,1y",
         teacher: str | None = None, periphery: bool = False, synthetic: int | None = None,
         clip_sigma: float | None = None, weight_noise: float | None = None, out_noise: float | None = None,
         learn_ranges: bool = True, range_lr: float | None = None, clip: bool = True) -> dict:
    """Fine-tune ``model`` for the chip of ``preset_name`` (+ ``overrides``, AnalogConfig fields; default pcm) by
    ``method`` noise or dwp, or for the Analog Foundation Models chip (``method="afm"``, ``overrides`` AfmConfig
    fields) by their recipe: ``weight_noise`` and ``out_noise`` drawn every forward (defaults 0.03 and 0), input
    ranges learned (at ``range_lr``, default ``lr``) unless not ``learn_ranges``, rows clipped to ``clip_sigma`` std
    after each step (default 2.5) unless not ``clip``.
    ``synthetic``: train on this many tokens the model writes itself instead of Shakespeare (causal LMs).
    ``times``: "FROM,TO", the range the device reads' times are drawn from; ``teacher``: the model distilled from
    (default ``model`` itself); ``periphery``: the reads also pass the chip's converters and output noise
    (cim_sim.training.Periphery). Returns the settings and the loss per step; see the module docstring."""
    from hilt.cim_sim import afm
    from hilt.cim_sim.training import (
        METHODS, NoisyTraining, Periphery, clip_columns_, distillation_loss, embedding_distillation_loss,
    )
    from hilt.cim_sim.model import parse_time
    from hilt.models import bert, hf, llama
    from hilt.tasks.drift_lm import (
        afm_config, calibration_run, chip_config, chip_name, load_language_model, ranges_path,
    )
    from hilt.tasks.training_state import claim_state, load_state, save_state, state_meta

    out = Path(out)
    if method not in HWA_METHODS:
        raise HiltError(f"--method {method}: choose {', '.join(HWA_METHODS)}")
    if steps < 1 or batch < 1 or context < 2 or save_every < 1 or not lr > 0:
        raise HiltError("hwa needs steps, batch and save-every >= 1, a context >= 2 and a positive learning rate")
    if synthetic is not None and synthetic <= context:
        raise HiltError(f"--synthetic {synthetic}: the model's own text must be longer than --context {context} tokens")
    read_times = [parse_time(t) for t in times.split(",")]
    if len(read_times) != 2 or not 0 < read_times[0] <= read_times[1]:
        raise HiltError(f"--times {times}: expected FROM,TO after programming, 0 < FROM <= TO, e.g. 1d,1y")
    recipe = None
    if method == "afm":
        if preset_name not in (None, "afm"):
            raise HiltError(f"--preset {preset_name}: --method afm tunes for the afm chip (its fields by --set)")
        preset_name, config = "afm", afm_config(overrides)
        if not clip and clip_sigma is not None:
            raise HiltError("--clip-sigma and --no-clip: choose one")
        clip_sigma = 2.5 if clip_sigma is None else clip_sigma
        if not clip_sigma > 0:
            raise HiltError(f"--clip-sigma {clip_sigma}: rows are clipped at a positive number of standard deviations")
        recipe = afm.AfmTraining(weight_noise=0.03 if weight_noise is None else weight_noise,
                                 out_noise=0.0 if out_noise is None else out_noise, learn_ranges=learn_ranges)
        if not (recipe.weight_noise >= 0 and recipe.out_noise >= 0):
            raise HiltError(f"--weight-noise and --out-noise must be 0 or more; got {recipe.weight_noise}, "
                            f"{recipe.out_noise}")
        if range_lr is not None and not (range_lr > 0 and learn_ranges):
            raise HiltError(f"--range-lr {range_lr}: a positive rate for learned ranges (not with --fixed-ranges)")
        cfg = NoisyTraining(method="noise", noise_model="pcm", eta=1.0).validate()
    else:
        given = [f for f, v in (("--clip-sigma", clip_sigma), ("--weight-noise", weight_noise),
                                ("--out-noise", out_noise), ("--fixed-ranges", not learn_ranges or None),
                                ("--range-lr", range_lr), ("--no-clip", not clip or None)) if v is not None]
        if given:
            raise HiltError(f"{', '.join(given)}: the afm recipe's options; they apply to --method afm")
        preset_name = preset_name or "pcm"
        if preset_name == "afm":
            raise HiltError("--preset afm: the afm chip is tuned for by --method afm")
        config = chip_config(preset_name, overrides)
        config.device_model()  # validates the configuration
        if config.device not in ("pcm", "rram"):
            raise HiltError(f"--preset {preset_name}: the device is {config.device!r}; hwa trains against pcm or rram noise")
        cfg = NoisyTraining(method=method, noise_model=config.device, eta=eta, eta_min=eta_min, eta_max=eta_max,
                            copies=copies if METHODS[method].min_copies > 1 else 1,  # noise draws one copy
                            weighting=weighting).validate()
    _check_out(out, None, overwrite)
    state_dir = out.with_name(out.name + ".hwa-state")
    claim_state(state_dir, resume, overwrite)
    settings = {"model": model, "preset": preset_name, "config": dataclasses.asdict(config),
                "training": dataclasses.asdict(cfg), "times": read_times, "steps": steps, "lr": lr, "batch": batch,
                "context": context, "seed": seed, "teacher": teacher, "periphery": periphery}
    if recipe is not None:
        settings["recipe"] = {**dataclasses.asdict(recipe), "clip_sigma": clip_sigma if clip else None,
                              "range_lr": range_lr or lr}
    if synthetic is not None:
        settings["synthetic"] = synthetic
    source = _source(model)
    meta = state_meta(state_dir, settings) if resume else None
    lm = load_language_model(model)
    if synthetic is not None and lm.kind != "causal":
        raise HiltError(f"--synthetic: {model} is an encoder; a causal LM writes its own training text")
    as_gguf = isinstance(lm.model, llama.Llama)  # hilt's own Llama is written back as the GGUF it was read from
    _check_out(out, as_gguf, overwrite)
    student = copy.deepcopy(lm.model).train().requires_grad_(True)
    teacher = lm if teacher is None else _teacher(lm, teacher, model)
    if recipe is not None:
        afm.to_afm(student, config, inplace=True)
        afm.calibrate_ranges(student, calibration_run(lm))  # their init, from calibration batches
        for _, m in afm.afm_layers(student):
            m.training_noise = recipe
            m.input_range.requires_grad_(recipe.learn_ranges)
    ranges_of = [m.input_range for _, m in afm.afm_layers(student)] if recipe is not None else []
    weights = [p for p in student.parameters() if all(p is not r for r in ranges_of)]
    opt = torch.optim.AdamW([{"params": weights}] + ([{"params": ranges_of, "lr": range_lr or lr}] if ranges_of else []),
                            lr=lr, weight_decay=0.0)
    start = 0
    if meta is not None:
        start = load_state(state_dir, meta, student, opt)
        LOG.info(f"resuming at step {start} of {steps} from {state_dir}")
    if synthetic is not None:
        data = _synthetic_data(lm, model, synthetic, context, seed, synthetic_path(state_dir), progress)
    else:
        data = _training_data(lm)
    chip_periphery = Periphery.calibrated(lm.model, config, calibration_run(lm)) if periphery else None
    if lm.kind == "causal" and len(data) <= context:
        raise HiltError(f"the training text has {len(data)} tokens, fewer than --context {context}")
    loss_of = distillation_loss if lm.kind == "causal" else embedding_distillation_loss
    losses, clipped = [], 0.0
    bar = Progress(steps, "hwa", "step", initial=start, enabled=progress)
    for step in range(start, steps):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)  # the same batch and noise, resumed or not
        noisy, digital = _digital_and_noisy(lm, teacher, student, data, batch, context, cfg, config, read_times, gen,
                                            chip_periphery)
        loss = loss_of(noisy, digital, cfg)
        if not torch.isfinite(loss):
            raise HiltError(f"hwa loss became {float(loss)} at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        if recipe is not None:
            clipped = afm.clip_rows_(student, clip_sigma) if clip else 0.0
        elif config.clip_std:
            clipped = clip_columns_(student, config.clip_std)
        losses.append(float(loss.detach()))
        bar.done(f"step {step + 1}", f"loss {losses[-1]:.4g}")
        if (step + 1) % save_every == 0 and step + 1 < steps:
            save_state(state_dir, student, opt, step + 1, settings)
    bar.close()
    student.eval().requires_grad_(False)
    ranges = afm.from_afm(student) if recipe is not None else None
    if as_gguf:
        llama.save_gguf(student, source, out)
    elif lm.kind == "causal":
        hf.save_causal_lm(student, source, out)
    else:
        bert.save_folder(student, source, out)
    if ranges is not None:
        from hilt.atomic import write_json

        write_json(ranges_path(out), ranges)
    elif as_gguf:
        ranges_path(out).unlink(missing_ok=True)  # an earlier afm run's ranges belong to the weights just replaced
    shutil.rmtree(state_dir, ignore_errors=True)
    synthetic_path(state_dir).unlink(missing_ok=True)
    chip = preset_name if recipe is not None else chip_name(preset_name, config)
    LOG.info(f"wrote {out}: {lm.kind} model tuned for {chip} by {method}; distillation loss "
             + (f"{losses[0]:.4g} -> {losses[-1]:.4g}" if losses else "(no step left to run)")
             + (f"; {100 * clipped:.2f}% of weights at the clip" if recipe is not None or config.clip_std else "")
             + (f"; input ranges in {ranges_path(out)}" if ranges is not None else ""))
    return {"out": str(out), **settings, "resumed_at": start, "losses": losses, "clipped_share": clipped,
            "input_ranges": ranges}
