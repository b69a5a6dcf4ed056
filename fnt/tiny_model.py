"""Write a tiny Hugging Face causal LM directory for tests and demos (side effect: files in --out).

The directory holds a config, safetensors weights and a byte-level tokenizer with a chat template,
so `AutoModelForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)` load it
offline, through exactly the path the trainer uses for real models. The command line is
`fnt make-tiny-model --out DIR [options]`; the same seed and options write the same files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML: each message is `<|im_start|>role\ncontent<|im_end|>\n`. The assistant turn therefore
# ends with `<|im_end|>`, which the model learns to emit and generation stops on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer with one token per byte (256) plus the chat special tokens, and no merges."""
    byte_to_char = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_to_char))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|pad|>")],
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 4096
    return tok


def tiny_config(vocab_size: int, pad_id: int, eos_id: int, args: argparse.Namespace):
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
        tie_word_embeddings=args.tie,
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


def make_tiny_model(out: Path, args: argparse.Namespace) -> None:
    tok = byte_level_tokenizer()
    config = tiny_config(len(tok), tok.pad_token_id, tok.eos_token_id, args)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fnt make-tiny-model", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory to write")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE model instead of a dense Llama")
    p.add_argument("--tie", action="store_true", help="tie the LM head to the input embedding")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer (with --moe)")
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0, help="seed of the random initial weights")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    make_tiny_model(args.out, args)
    print(json.dumps({"out": str(args.out), "moe": args.moe}))
