"""Studies behind `hilt bench` and the report: the quantization table, robustness, QAT scaling, FP8 scales and transients."""
