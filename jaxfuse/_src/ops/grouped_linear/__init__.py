"""grouped_linear: a grouped GEMM for mixture-of-experts layers, sizes kept on the device."""
