"""vd ops of the scheduler family (being written)."""
