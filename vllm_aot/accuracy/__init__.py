"""Accuracy checks of compiled models against HF transformers."""
