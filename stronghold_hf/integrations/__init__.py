"""Hugging Face integrations: Trainer arguments, Trainer subclasses and the accelerate plugin."""
