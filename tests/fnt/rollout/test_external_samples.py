"""External rollout samples: non-finite values are rejected with the file and line, and
ref_logprobs reach the packed micro-batches at their tokens."""

from __future__ import annotations

import json
import types

import pytest

from fnt.config import ModelConfig, RLConfig, RLLossConfig, RolloutConfig
from fnt.distributed.runtime import setup_trainer
from fnt.errors import DataError
from fnt.rollout.engines.external import ExternalRollouts, parse_sample, rollout_dir
from fnt.state import Progress
from fnt.store.transaction import COMPLETE_MARKER


def line(**fields) -> str:
    record = {"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "advantage": 1.0, **fields}
    return json.dumps(record)  # json writes NaN and Infinity, and reads them back


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"inference_logprobs": [-0.1, float("nan"), -0.3]}, "'inference_logprobs' must be finite"),
        (
            {"inference_logprobs": [-0.1, -0.2, float("-inf")]},
            "'inference_logprobs' must be finite",
        ),
        ({"ref_logprobs": [float("inf"), -0.2, -0.3]}, "'ref_logprobs' must be finite"),
        ({"ref_logprobs": [-0.1, -0.2]}, "'ref_logprobs' needs one value per completion token"),
        ({"ref_logprobs": [-0.1, "x", -0.3]}, "'ref_logprobs' must be numbers"),
        ({"advantage": float("nan")}, "'advantage' must be a finite number"),
        ({"advantage": float("inf")}, "'advantage' must be a finite number"),
        # Finite in float64 but not in the float32 the micro-batches store them in.
        ({"inference_logprobs": [-0.1, -1e39, -0.3]}, "'inference_logprobs' must be finite"),
        ({"advantage": 1e39}, "'advantage' must be a finite number .in float32"),
        ({"temperature": 1e39}, "'temperature' must be a finite number .in float32"),
        # Not a log-probability: above 0 by more than a sampler's rounding.
        ({"inference_logprobs": [-0.1, 0.7, -0.3]}, "'inference_logprobs' must be finite log-p"),
        ({"ref_logprobs": [0.01, -0.2, -0.3]}, "'ref_logprobs' must be finite log-p"),
        # A negative id would break the tokenizer's decoding of the saved samples.
        ({"prompt_ids": [10, -1, 12]}, r"'prompt_ids'\[1\] = -1 is not a token id"),
        ({"completion_ids": [3, 4, -7]}, r"'completion_ids'\[2\] = -7 is not a token id"),
    ],
)
def test_non_finite_or_malformed_values_name_the_file_and_line(fields, message):
    with pytest.raises(DataError, match=f"samples.jsonl, line 4: {message}"):
        parse_sample(line(**fields), "samples.jsonl, line 4")


def test_a_logprob_a_little_above_0_from_a_samplers_rounding_is_accepted():
    sample, *_ = parse_sample(line(inference_logprobs=[-0.1, 1e-6, 0.0]), "f, line 1")
    assert sample.logprobs == (0.0, 0.0, -0.1, 1e-6, 0.0)


def test_a_sample_parses_its_reference_logprobs():
    sample, temperature, has_logprobs, ref, *_ = parse_sample(
        line(ref_logprobs=[-1, -2.5, -0.5], temperature=0.7), "f, line 1"
    )
    assert ref == [0.0, 0.0, -1.0, -2.5, -0.5] and not has_logprobs and temperature == 0.7
    assert parse_sample(line(), "f, line 1")[3] is None


def external_config(model_dir, out, **loss) -> RLConfig:
    return RLConfig(
        model=ModelConfig(name=str(model_dir)),
        output_dir=str(out),
        seq_len=16,
        batch_size=2,
        micro_batch_size=1,
        rollout=RolloutConfig(engine="external"),
        loss=RLLossConfig(**loss),
    )


def write_step(out, lines) -> None:
    path = rollout_dir(str(out), 1)
    path.mkdir(parents=True)
    (path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    (path / COMPLETE_MARKER).write_text("")


def test_ref_logprobs_are_packed_at_their_tokens(tiny_model_dir, tmp_path):
    config = external_config(tiny_model_dir, tmp_path, ref_kl_tau=0.1, ref_source="rollouts")
    lines = [
        line(ref_logprobs=[-1.0, -2.0, -3.0], inference_logprobs=[-0.5, -0.5, -0.5]),
        json.dumps(
            {
                "prompt_ids": [7, 8, 9],
                "completion_ids": [1, 2],
                "advantage": -1.0,
                "ref_logprobs": [-4.0, -5.0],
                "inference_logprobs": [-0.25, -0.25],
            }
        ),
        line(ref_logprobs=[-6.0, -7.0, -8.0], inference_logprobs=[-0.5, -0.5, -0.5]),
    ]
    write_step(tmp_path, lines)
    reader = ExternalRollouts(config, setup_trainer(config))
    batch = reader.rollout(types.SimpleNamespace(progress=Progress()))
    packed = []
    for mb in batch.micro_batches:
        mb.check()
        mask = mb.rows.loss_mask
        packed += mb.ref_logprobs[mask].tolist()
        # The inference logprobs sit at the same tokens as always.
        assert set(mb.inference_logprobs[mask].tolist()) <= {-0.5, -0.25}
    # Samples fill rows in order, so the loss tokens' values come back in the file's order.
    assert packed == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]


def test_missing_ref_logprobs_name_the_file(tiny_model_dir, tmp_path):
    config = external_config(tiny_model_dir, tmp_path, ref_kl_tau=0.1, ref_source="rollouts")
    write_step(tmp_path, [line(), line()])
    reader = ExternalRollouts(config, setup_trainer(config))
    with pytest.raises(
        DataError, match=r"step_1/samples.jsonl: the samples have no 'ref_logprobs'"
    ):
        reader.rollout(types.SimpleNamespace(progress=Progress()))


def test_ref_logprobs_on_some_samples_only_are_rejected(tiny_model_dir, tmp_path):
    config = external_config(tiny_model_dir, tmp_path)
    write_step(tmp_path, [line(ref_logprobs=[-1.0, -1.0, -1.0]), line()])
    reader = ExternalRollouts(config, setup_trainer(config))
    with pytest.raises(DataError, match="either every sample has 'ref_logprobs' or none has"):
        reader.rollout(types.SimpleNamespace(progress=Progress()))
