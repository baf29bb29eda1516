"""The `vllm-aot` command: each subcommand a thin call into the packages below."""
