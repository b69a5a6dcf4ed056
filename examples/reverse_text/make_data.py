"""Write the reverse-text data set (side effect: JSONL files in --out).

Each sample asks to reverse a random lowercase string: the user says `reverse: abcdef`, the
assistant answers `fedcba`. Three disjoint splits come from one seeded generator:

- sft.jsonl      chat samples ({"messages": [...]}) for SFT
- rl.jsonl       prompts with answers ({"prompt": ..., "answer": ...}) for RL
- heldout.jsonl  prompts with answers for the eval, never trained on
- dpo.jsonl      preference pairs ({"prompt": ..., "chosen": ..., "rejected": ...}) for DPO:
                 the correct reversal preferred to a corrupted one (`corrupt`)
- dpo_val.jsonl  held-out pairs for DPO's val/ metrics

The DPO texts are drawn after the others, so adding them left the other splits as they were.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

PROMPT_PREFIX = "reverse: "


def random_text(rng: random.Random, min_len: int, max_len: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))


def unique_texts(
    rng: random.Random, count: int, min_len: int, max_len: int, taken: set[str]
) -> list[str]:
    texts: list[str] = []
    while len(texts) < count:
        text = random_text(rng, min_len, max_len)
        if text not in taken:
            taken.add(text)
            texts.append(text)
    return texts


def prompt_record(text: str) -> dict:
    return {"prompt": PROMPT_PREFIX + text, "answer": text[::-1]}


def chat_record(text: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": PROMPT_PREFIX + text},
            {"role": "assistant", "content": text[::-1]},
        ]
    }


def corrupt(rng: random.Random, answer: str) -> str:
    """A wrong answer close to `answer`, made the way a half-trained model errs: a letter
    changed, two neighbours swapped, the tail cut off or a letter repeated."""
    i = rng.randrange(len(answer))
    kind = rng.randrange(4)
    if kind == 0:
        letter = rng.choice([c for c in string.ascii_lowercase if c != answer[i]])
        return answer[:i] + letter + answer[i + 1 :]
    if kind == 1 and len(answer) > 1:
        i = min(i, len(answer) - 2)
        return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
    if kind == 2 and len(answer) > 2:
        return answer[: rng.randint(1, len(answer) - 1)]
    return answer[: i + 1] + answer[i] + answer[i + 1 :]


def pair_record(rng: random.Random, text: str) -> dict:
    answer = text[::-1]
    rejected = corrupt(rng, answer)
    while rejected == answer:
        rejected = corrupt(rng, answer)
    return {"prompt": PROMPT_PREFIX + text, "chosen": answer, "rejected": rejected}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sft", type=int, default=20000, help="SFT samples")
    p.add_argument("--rl", type=int, default=5000, help="RL prompts")
    p.add_argument("--heldout", type=int, default=200, help="held-out eval prompts")
    p.add_argument("--dpo", type=int, default=4000, help="DPO preference pairs")
    p.add_argument("--dpo-val", type=int, default=100, help="held-out DPO pairs")
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    taken: set[str] = set()
    heldout = unique_texts(rng, args.heldout, args.min_len, args.max_len, taken)
    sft = unique_texts(rng, args.sft, args.min_len, args.max_len, taken)
    rl = unique_texts(rng, args.rl, args.min_len, args.max_len, taken)
    dpo = unique_texts(rng, args.dpo + args.dpo_val, args.min_len, args.max_len, taken)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "heldout.jsonl", [prompt_record(t) for t in heldout])
    write_jsonl(args.out / "sft.jsonl", [chat_record(t) for t in sft])
    write_jsonl(args.out / "rl.jsonl", [prompt_record(t) for t in rl])
    pairs = [pair_record(rng, t) for t in dpo]
    write_jsonl(args.out / "dpo.jsonl", pairs[: args.dpo])
    write_jsonl(args.out / "dpo_val.jsonl", pairs[args.dpo :])
    counts = {"sft": len(sft), "rl": len(rl), "heldout": len(heldout), "dpo": args.dpo}
    print(json.dumps({"out": str(args.out), **counts}))


if __name__ == "__main__":
    main()
