"""cim_sim: compute-in-memory simulation in vectorised PyTorch.

    from hilt.cim_sim import convert_to_analog, program, drift_to, preset, evaluate
    analog = convert_to_analog(model, preset("pcm"))   # Linear/Conv2d -> analog layers (a copy)
    program(analog, seed=0)                            # programming noise, drift exponents
    drift_to(analog, 86400, seed=1, gdc="global")      # read one day later, compensated
    evaluate(analog, (inputs, labels))                 # one accuracy per programmed chip

    from hilt.cim_sim import certify, cim_perturbation        # weight-perturbation certificates
    certify(model, (images, labels), cim_perturbation(model, "pcm", 86400)).fractions()

Certificates in modules by concern: cert_chain (the model as a chain), cert_bounds (the bounds),
cert_chip (a chip's perturbation); a format's is quant.cert_quant. The derivation: docs/certify.md.
"""

from hilt.cim_sim.analog import AnalogConv1d, AnalogConv2d, AnalogLinear
from hilt.cim_sim.config import PRESETS, AnalogConfig, preset
from hilt.cim_sim.cert_bounds import Certificates, analyze, certify
from hilt.cim_sim.cert_chip import cim_perturbation
from hilt.cim_sim.devices import PCM, RRAM, mismatch, stuck_at
from hilt.cim_sim.model import (analog_layers, calibrate_inputs, chip_memory, clipped_share, convert_to_analog,
                                drift_to, evaluate, needs_calibration, parse_time, program,
                                stacked_chips)
from hilt.quant.cert_quant import Perturbation, quantization_perturbation

__all__ = [
    "PRESETS", "AnalogConfig", "AnalogConv1d", "AnalogConv2d", "AnalogLinear", "preset", "PCM", "RRAM", "mismatch", "stuck_at",
    "analog_layers", "convert_to_analog", "drift_to", "evaluate", "parse_time", "program",
    "calibrate_inputs", "needs_calibration", "chip_memory", "clipped_share", "stacked_chips",
    "Certificates", "Perturbation", "analyze", "certify", "cim_perturbation", "quantization_perturbation",
]
