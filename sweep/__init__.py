"""The warm-up sweep's suggestions: pure, stdlib-only math run by the suggest activity."""
