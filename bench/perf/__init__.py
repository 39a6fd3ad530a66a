"""Speed benchmarks (LUT kernels, FP8 attention, quantization, the CIM simulator) and the GPU check."""
