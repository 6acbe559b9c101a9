"""linear_scale_add: residual + alpha * (x @ kernel), one GEMM accumulating in place."""
