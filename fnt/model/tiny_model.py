"""Write a tiny Hugging Face causal LM directory for tests and demos. Side effects:
`make_tiny_model_` writes --out and reads the --chat-template file; `main` prints a summary.

--out is written whole or not at all, and only where no one else's files are (the rules of
fnt.store.paths.check_output_dir: new, empty, a tiny model written before, or `--force`).

The directory holds a config, safetensors weights and a byte-level tokenizer with a chat template,
so `AutoModelForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)` load it
offline, through exactly the path the trainer uses for real models. The command line is
`fnt make-tiny-model --out DIR [options]`; the same seed and options write the same files, on
any machine (`portable_init_`).

Architectures: a dense Llama (default), a Qwen3-MoE (`--moe`), or `--arch qwen3`: Qwen3-0.6B's
architecture (Qwen3ForCausalLM with its config.json's fields: q/k norms, rope theta 1e6, tied
embeddings, heads twice as wide in total as the hidden size) shrunk to the sizes given here and to
the byte-level vocabulary, for running real-model configs on random weights. `--chat-template
FILE` replaces the ChatML template and special tokens with a real model's (a Jinja file, or a JSON
object such as a tokenizer_config.json with `chat_template`, `eos_token`, `pad_token`,
`bos_token` and `additional_special_tokens`); the vocabulary stays one token per byte plus those
special tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from fnt.errors import ConfigError
from fnt.store.paths import TINY_MODEL, check_output_dir, require_file
from fnt.store.transaction import output_marker, staged_dir_

# torch, tokenizers and transformers are imported where the model is made, after the arguments
# and paths are checked: a bad --out or --chat-template answers at once.
if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML: each message is `<|im_start|>role\ncontent<|im_end|>\n`. The assistant turn therefore
# ends with `<|im_end|>`, which the model learns to emit and generation stops on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Qwen3-0.6B's config.json (huggingface.co/Qwen/Qwen3-0.6B), its architecture fields: what
# `--arch qwen3` keeps. Sizes, vocabulary and token ids come from the command line and tokenizer.
QWEN3_0_6B = dict(
    attention_bias=False,
    attention_dropout=0.0,
    head_dim=128,
    hidden_act="silu",
    hidden_size=1024,
    initializer_range=0.02,
    intermediate_size=3072,
    max_position_embeddings=40960,
    max_window_layers=28,
    num_attention_heads=16,
    num_hidden_layers=28,
    num_key_value_heads=8,
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=1000000,
    sliding_window=None,
    tie_word_embeddings=True,
    use_sliding_window=False,
    vocab_size=151936,
)
# Qwen3's generation_config.json stops at <|im_end|> (the tokenizer's eos) and at <|endoftext|>.
QWEN3_EXTRA_STOP = "<|endoftext|>"


def byte_level_tokenizer(
    chat_template: str = CHAT_TEMPLATE,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|pad|>",
    bos_token: Optional[str] = None,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per byte (256) plus the special tokens (eos, pad and bos
    among them), and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_to_char))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    named = [t for t in (eos_token, pad_token, bos_token) if t is not None]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=eos_token,
        pad_token=pad_token,
        bos_token=bos_token,
        unk_token=None,
        additional_special_tokens=[t for t in special_tokens if t not in named],
    )
    # Every special token once, in a fixed order, so that the same options give the same ids.
    everything = list(dict.fromkeys([*special_tokens, *named]))
    tok.add_special_tokens({"additional_special_tokens": everything})
    tok.chat_template = chat_template
    tok.model_max_length = 4096
    return tok


def tokenizer_from_template_file(path: Path) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with the chat template (and special tokens) of `path`;
    ConfigError for a JSON file that is not an object with a chat_template."""
    text = chat_template_text(path)
    if path.suffix != ".json":
        return byte_level_tokenizer(chat_template=text)
    spec = chat_template_spec(path, text)
    eos = _token_text(spec.get("eos_token")) or "<|im_end|>"
    pad = _token_text(spec.get("pad_token")) or "<|pad|>"
    bos = _token_text(spec.get("bos_token"))
    extra = [_token_text(t) for t in spec.get("additional_special_tokens") or []]
    return byte_level_tokenizer(spec["chat_template"], eos, pad, bos, [t for t in extra if t])


def chat_template_text(path: Path) -> str:
    """The text of the --chat-template file; ConfigError when it cannot be read as text."""
    require_file(path, "--chat-template")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {str(path)!r}: cannot read it: {exc}") from None


def chat_template_spec(path: Path, text: str) -> dict:
    """A JSON --chat-template's object; ConfigError unless it is one with a chat_template."""
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--chat-template {str(path)!r}: not JSON ({exc})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("chat_template"), str):
        raise ConfigError(
            f"--chat-template {str(path)!r}: expected a JSON object with a 'chat_template'"
        )
    return spec


def _token_text(token: Any) -> Optional[str]:
    """A special token as a tokenizer_config.json writes it: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def tiny_config(vocab_size: int, pad_id: int, eos_id: int, args: argparse.Namespace):
    """The model config: the architecture `args` selects at the sizes `args` gives."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    tie = args.tie if args.tie is not None else args.arch == "qwen3"
    common = dict(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=tie,
    )
    if args.arch == "qwen3":
        # Qwen3-0.6B's heads are 128 wide, 16 of them over a hidden size of 1024: the attention
        # projections are twice the hidden size. The shrunk model keeps that ratio.
        ratio = (
            QWEN3_0_6B["head_dim"] * QWEN3_0_6B["num_attention_heads"] // QWEN3_0_6B["hidden_size"]
        )
        shrunk = {"head_dim": ratio * args.hidden_size // args.heads}
        return Qwen3Config(
            **{**QWEN3_0_6B, **common, **shrunk, "intermediate_size": args.intermediate_size}
        )
    if args.moe:
        return Qwen3MoeConfig(
            **common,
            head_dim=args.hidden_size // args.heads,
            intermediate_size=args.intermediate_size,
            moe_intermediate_size=args.intermediate_size // 2,
            num_experts=args.experts,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            router_aux_loss_coef=0.0,
        )
    return LlamaConfig(**common, intermediate_size=args.intermediate_size)


def portable_init_(model: torch.nn.Module, std: float, seed: int) -> None:
    """Give every weight matrix (every parameter of two or more dimensions) uniform values of
    standard deviation `std`, drawn from `seed` alone; the vectors (norm weights, biases) keep
    the constant values the model was built with.

    Hugging Face's normal init goes through torch's CPU normal sampler, whose log/cos run in other
    kernels (and round differently) on other CPUs: the "same" tiny model then differs in the last
    bits from machine to machine, and so does every number trained from it. Uniform values are
    random integers scaled by exactly rounded float64 operations, the same bits everywhere.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    half_width = std * 3**0.5  # a uniform on [-a, a] has standard deviation a / sqrt(3)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):  # tied weights appear once
            if param.dim() >= 2:
                unit = torch.rand(param.shape, dtype=torch.float64, generator=generator)
                param.copy_((unit * 2 - 1) * half_width)


def make_tiny_model_(out: Path, args: argparse.Namespace) -> None:
    """Write the model `args` describe, with its tokenizer, into the existing directory `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = (
        byte_level_tokenizer()
        if args.chat_template is None
        else tokenizer_from_template_file(args.chat_template)
    )
    config = tiny_config(len(tok), tok.pad_token_id, tok.eos_token_id, args)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    portable_init_(model, config.initializer_range, args.seed)
    extra_stop = tok.convert_tokens_to_ids(QWEN3_EXTRA_STOP)
    if args.arch == "qwen3" and extra_stop is not None and extra_stop != tok.eos_token_id:
        model.generation_config.eos_token_id = [tok.eos_token_id, extra_stop]
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fnt make-tiny-model", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="directory to write: new, empty, or a tiny model written before (replaced)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace --out even when it holds other files (never a run directory)",
    )
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE model instead of a dense Llama")
    p.add_argument(
        "--arch",
        choices=("llama", "qwen3"),
        default="llama",
        help="dense architecture: Llama, or Qwen3-0.6B's (Qwen3ForCausalLM) shrunk to these sizes",
    )
    p.add_argument(
        "--tie",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tie the LM head to the input embedding (default: tied for --arch qwen3 only)",
    )
    p.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        help="a Jinja chat template, or a JSON object with chat_template and the special tokens",
    )
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (with --moe)")
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0, help="seed of the random initial weights")
    args = p.parse_args(argv)
    if args.moe and args.arch != "llama":
        p.error("--moe writes a Qwen3-MoE model; --arch chooses among the dense ones")
    return args


def main(argv: list[str] | None = None) -> None:
    """`fnt make-tiny-model`: check the arguments, then write --out whole or not at all."""
    args = parse_args(argv)
    check_output_dir(args.out, "--out", TINY_MODEL, force=args.force)
    if args.chat_template is not None:
        text = chat_template_text(args.chat_template)
        if args.chat_template.suffix == ".json":
            chat_template_spec(args.chat_template, text)
    # The options that shape the files (not where they go, or whether to replace them).
    asked = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in ("out", "force")
    }
    with staged_dir_(args.out, output_marker(TINY_MODEL, **asked), "--out") as partial:
        make_tiny_model_(partial, args)
    print(json.dumps({"out": str(args.out), "moe": args.moe, "arch": args.arch}))
