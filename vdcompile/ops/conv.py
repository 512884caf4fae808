"""vd ops of the conv family (being written)."""
