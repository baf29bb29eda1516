"""The compile cache: content-addressed programs, a remote tier, a registry of configurations."""
