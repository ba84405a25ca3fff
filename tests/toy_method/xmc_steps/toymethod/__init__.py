"""A toy method (the label-frequency prior), registered as a real one would be (tests/toy_method)."""
