"""FP8 quantization (current, block and MXFP8 scaling) and its fusion with the scaled activations."""
