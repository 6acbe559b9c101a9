"""scaled_activation: SwiGLU / squared ReLU / clamped SwiGLU times a per-row scale."""
