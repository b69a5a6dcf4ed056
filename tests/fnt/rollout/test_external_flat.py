"""The external protocol's flat form: token_ids with a mask of the sampled tokens (multi-turn
samples), its located errors, and that it packs exactly as the prompt/completion form."""

from __future__ import annotations

import json
import types

import pytest
import torch

from fnt.distributed.runtime import setup_trainer
from fnt.errors import DataError
from fnt.rollout.engines.external import ExternalRollouts, parse_sample
from fnt.state import Progress

from .test_external_samples import external_config, write_step

# prompt (3) | turn 1 (2 sampled) | tool result (2) | turn 2 (2 sampled)
TOKENS = [1, 2, 3, 10, 11, 20, 21, 12, 13]
MASK = [0, 0, 0, 1, 1, 0, 0, 1, 1]
LOGPROBS = [None, None, None, -0.5, -0.25, None, None, -1.0, -0.75]


def flat(**fields) -> str:
    record = {"token_ids": TOKENS, "mask": MASK, "logprobs": LOGPROBS, "advantage": 1.0}
    return json.dumps({**record, **fields})


def test_a_flat_line_parses_into_its_trajectory():
    sample, temperature, has_logprobs, ref, *_ = parse_sample(
        flat(reward=0.5, turns=2, tool_calls=1, ref_logprobs=LOGPROBS), "f, line 1"
    )
    assert sample.token_ids == tuple(TOKENS) and sample.sampled == tuple(map(bool, MASK))
    assert sample.logprobs == tuple(0.0 if v is None else v for v in LOGPROBS)
    assert (sample.reward, sample.advantage, sample.turns, sample.tool_calls) == (0.5, 1.0, 2, 1)
    assert has_logprobs and temperature == 1.0 and ref == list(sample.logprobs)
    assert not sample.truncated and not sample.out_of_turns


def test_an_orchestrator_reports_a_length_cut_and_running_out_of_turns_apart():
    from fnt.rollout.base import episode_metrics, episode_sums

    lines = [flat(truncated=True), flat(out_of_turns=True, turns=2), flat()]
    samples = [parse_sample(line, f"f, line {i}")[0] for i, line in enumerate(lines, 1)]
    assert [(s.truncated, s.out_of_turns) for s in samples] == [
        (True, False),
        (False, True),
        (False, False),
    ]
    metrics = episode_metrics(episode_sums(samples))
    assert metrics["rollout/truncated_episodes"] == metrics["rollout/max_turns_episodes"] == 1.0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"mask": MASK[:-1]}, r"'mask' has 8 values for the 9 tokens of 'token_ids'"),
        (
            {"logprobs": [-0.1, *LOGPROBS[1:]]},
            r"'logprobs' has -0.1 at token 0, which 'mask' does not mark sampled",
        ),
        ({"logprobs": [*LOGPROBS[:3], None, *LOGPROBS[4:]]}, r"'logprobs' has no value at token 3"),
        ({"logprobs": LOGPROBS[:5]}, r"'logprobs' needs one entry per token of 'token_ids' \(9\)"),
        ({"mask": [0] * 9, "logprobs": None}, r"'mask' marks no token as sampled"),
        ({"mask": [1] + MASK[1:], "logprobs": None}, r"'mask' marks token 0 as sampled"),
        ({"mask": [0, 2, *MASK[2:]]}, r"'mask' must be a list of 0 and 1"),
        ({"prompt_ids": [1]}, r"give either 'token_ids' with 'mask' .* not both"),
        ({"mask": None}, r"'mask' must be a list"),
        (
            {"ref_logprobs": [None, None, None, -0.5, 0.5, None, None, -1.0, -1.0]},
            r"'ref_logprobs' must be finite log-probabilities",
        ),
        ({"turns": -1}, r"'turns' must be an integer >= 0"),
        ({"out_of_turns": 1}, r"'out_of_turns' must be true or false"),
        ({"token_ids": [5, -2, *range(7)]}, r"'token_ids'\[1\] = -2 is not a token id"),
    ],
)
def test_each_malformed_flat_field_is_a_located_error(fields, message):
    record = json.loads(flat())
    record.update(fields)
    record = {k: v for k, v in record.items() if v is not None or k == "mask"}
    with pytest.raises(DataError, match=f"samples.jsonl, line 7: {message}"):
        parse_sample(json.dumps(record), "samples.jsonl, line 7")


def test_flat_samples_train_only_their_masked_tokens(tiny_model_dir, tmp_path):
    config = external_config(tiny_model_dir, tmp_path)
    single = json.dumps(
        {
            "prompt_ids": [1, 2, 3],
            "completion_ids": [4, 5],
            "inference_logprobs": [-0.5, -0.5],
            "advantage": -1.0,
        }
    )
    as_flat = json.dumps(
        {
            "token_ids": [1, 2, 3, 4, 5],
            "mask": [0, 0, 0, 1, 1],
            "logprobs": [None, None, None, -0.5, -0.5],
            "advantage": -1.0,
        }
    )
    write_step(tmp_path, [flat(), single, flat(advantage=0.5), as_flat])
    reader = ExternalRollouts(config, setup_trainer(config))
    batch = reader.rollout(types.SimpleNamespace(progress=Progress()))
    trained, values = [], []
    for mb in batch.micro_batches:
        mb.check()
        for r, lengths in enumerate(mb.sample_lengths):
            start = 0
            for length in lengths:
                span = slice(start, start + length)
                trained.append(mb.rows.loss_mask[r, span].int().tolist())
                values.append(mb.inference_logprobs[r, span][mb.rows.loss_mask[r, span]].tolist())
                start += length
    assert sorted(trained) == sorted([MASK, [0, 0, 0, 1, 1], MASK, [0, 0, 0, 1, 1]])
    assert sorted(values) == sorted([[-0.5, -0.25, -1.0, -0.75]] * 2 + [[-0.5, -0.5]] * 2)
    # The single-turn line and its flat form are the same sample.
    a, *_ = parse_sample(single, "f, line 2")
    b, *_ = parse_sample(as_flat, "f, line 4")
    assert a == b
    assert batch.metrics["rollout/turns/mean"] == 1.0
    assert batch.metrics["rollout/sampled_tokens"] == 12.0
    assert batch.metrics["rollout/context_tokens"] == 16.0
    assert torch.isfinite(torch.tensor(batch.metrics["reward/mean"]))
