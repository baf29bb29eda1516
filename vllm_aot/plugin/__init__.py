"""The vLLM seam: everything that imports vLLM lives in this package."""
