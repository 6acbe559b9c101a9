"""Flax modules over jaxfuse's functional ops: ``jaxfuse.flax.linen`` and ``jaxfuse.flax.nnx``."""
