"""Pure-Python scheduling logic: tiers, validation, priority and deadline. No Triton imports."""
