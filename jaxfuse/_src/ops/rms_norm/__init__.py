"""rms_norm and add_rms_norm: RMSNorm and residual-add + RMSNorm, one pass over memory."""
