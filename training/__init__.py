"""Trains the embedded default model (`python -m training.train_default`); a development tool, not part of the
installed package."""
