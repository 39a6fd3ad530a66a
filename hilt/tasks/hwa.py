"""`hilt hwa MODEL OUT --method noise|dwp`: fine-tune a language model for a CIM chip.

The digital model is distilled into a copy of itself that is trained through noisy reads of the
chip's devices (cim_sim.training): every Linear the chip would hold (those `convert_to_analog`
puts on arrays) is replaced, in each forward, by one programmed-and-drifted read of the preset's
device at a time drawn log-uniformly between 1 s and 1 year (``times``: another range, e.g. the
late part of a deployment), mapped to conductances as the configuration says
(``weight_mapping``, ``devices_per_weight``); the gradient reaches the clean weights straight through the device.

- ``noise``: one read per step at noise level ``eta`` (1 = the published device);
- ``dwp``: ``copies`` reads per step at levels spread over [eta_min, eta_max], each token (or
  sentence) weighted by how much the reads disagree on it.

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


def _digital_and_noisy(lm, teacher, student, data, batch: int, context: int, cfg, chip, times,
                       gen: torch.Generator, periphery=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's inputs through the teacher (a LanguageModel) and through cfg's noisy reads of the student on
    ``chip``'s devices (an AnalogConfig: its device and weight mapping), read at a time within ``times``, and
    through ``periphery`` (cim_sim.training.Periphery) where given: (K, N, C) noisy outputs and (N, C) digital
    ones, N tokens or sentences."""
    from hilt.cim_sim.training import analog_weights, perturb
    from hilt.models.bert import mean_pool

    if lm.kind == "causal":
        starts = torch.randint(len(data) - context, (batch,), generator=gen)
        args = (data[starts[:, None] + torch.arange(context)],)

        def run(model, params=None, via=lm):
            if params is None:
                return via.logits(model, *args).flatten(0, 1)
            out = functional_call(model, params, args)
            return getattr(out, "logits", out).flatten(0, 1)  # a transformers model's output holds its logits
    else:
        picks = torch.randint(len(data), (batch,), generator=gen).tolist()
        ids, mask = lm.encode([data[i] for i in picks])
        args = (ids, mask)

        def run(model, params=None, via=lm):
            hidden = via.hidden(model, *args) if params is None else functional_call(model, params, args)
            return mean_pool(hidden, mask)
    with torch.no_grad():
        digital = run(teacher.model, via=teacher)
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


def tune(model: str, out, method: str = "noise", preset_name: str = "pcm", overrides: dict | None = None,
         eta: float = 1.0, eta_min: float = 0.5, eta_max: float = 1.5, copies: int = 2, weighting: str = "js",
         steps: int = 60, lr: float = 2e-5, batch: int = 4, context: int = 128, save_every: int = 10, seed: int = 0,
         resume: bool = False, overwrite: bool = False, progress: bool = True, times: str = "1s,1y",
         teacher: str | None = None, periphery: bool = False) -> dict:
    """Fine-tune ``model`` for the chip of ``preset_name`` (+ ``overrides``, AnalogConfig fields); see the
    module docstring. ``times``: "FROM,TO", the range the device reads' times are drawn from; ``teacher``:
    the model distilled from (default ``model`` itself); ``periphery``: the reads also pass the chip's
    converters and output noise (cim_sim.training.Periphery). Returns the settings and the loss per step."""
    from hilt.cim_sim.training import (
        METHODS, NoisyTraining, Periphery, clip_columns_, distillation_loss, embedding_distillation_loss,
    )
    from hilt.cim_sim.model import parse_time
    from hilt.models import bert, hf, llama
    from hilt.tasks.drift_lm import calibration_run, chip_config, load_language_model
    from hilt.tasks.training_state import claim_state, load_state, save_state, state_meta

    out = Path(out)
    if method not in ("noise", "dwp"):
        raise HiltError(f"--method {method}: choose noise or dwp")
    if steps < 1 or batch < 1 or context < 2 or save_every < 1 or not lr > 0:
        raise HiltError("hwa needs steps, batch and save-every >= 1, a context >= 2 and a positive learning rate")
    read_times = [parse_time(t) for t in times.split(",")]
    if len(read_times) != 2 or not 0 < read_times[0] <= read_times[1]:
        raise HiltError(f"--times {times}: expected FROM,TO after programming, 0 < FROM <= TO, e.g. 1d,1y")
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
    source = _source(model)
    meta = state_meta(state_dir, settings) if resume else None
    lm = load_language_model(model)
    as_gguf = isinstance(lm.model, llama.Llama)  # hilt's own Llama is written back as the GGUF it was read from
    _check_out(out, as_gguf, overwrite)
    student = copy.deepcopy(lm.model).train().requires_grad_(True)
    teacher = lm if teacher is None else _teacher(lm, teacher, model)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    start = 0
    if meta is not None:
        start = load_state(state_dir, meta, student, opt)
        LOG.info(f"resuming at step {start} of {steps} from {state_dir}")
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
        if config.clip_std:
            clipped = clip_columns_(student, config.clip_std)
        losses.append(float(loss.detach()))
        bar.done(f"step {step + 1}", f"loss {losses[-1]:.4g}")
        if (step + 1) % save_every == 0 and step + 1 < steps:
            save_state(state_dir, student, opt, step + 1, settings)
    bar.close()
    student.eval().requires_grad_(False)
    if as_gguf:
        llama.save_gguf(student, source, out)
    elif lm.kind == "causal":
        hf.save_causal_lm(student, source, out)
    else:
        bert.save_folder(student, source, out)
    shutil.rmtree(state_dir, ignore_errors=True)
    LOG.info(f"wrote {out}: {lm.kind} model tuned for {preset_name} by {method}; distillation loss "
             + (f"{losses[0]:.4g} -> {losses[-1]:.4g}" if losses else "(no step left to run)")
             + (f"; {100 * clipped:.2f}% of weights at the clip" if config.clip_std else ""))
    return {"out": str(out), **settings, "resumed_at": start, "losses": losses, "clipped_share": clipped}
