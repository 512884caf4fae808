"""vd ops of the attention family (being written)."""
