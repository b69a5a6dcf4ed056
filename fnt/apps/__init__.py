"""The `fnt` subcommands beside training. The command-line plumbing (cli), the checks made
before any model is built (preflight), export, inspect, plot, show-data and vllm-serve."""
