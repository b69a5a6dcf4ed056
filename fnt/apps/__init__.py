"""The `fnt` subcommands beside training. The command-line plumbing (cli), the checks made
before any model is built (preflight), export, inspect, plot, show-data and vllm-serve. Side
effects: each command's own (printing, reading runs, checkpoints and data, writing the outputs
it is asked for), named in its module; this file holds no code."""
