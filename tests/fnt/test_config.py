"""Config: JSON round trips, CLI > TOML > defaults, key spelling, error messages, validate()."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fnt.config import (
    CkptConfig,
    Config,
    ConfigError,
    DataConfig,
    DataSourceConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RuntimeConfig,
    ScheduleConfig,
    WandbConfig,
    all_keys,
    from_json,
    help_text,
    load_config,
    to_json,
    to_plain,
    validate,
)

REPO = Path(__file__).resolve().parents[2]
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _lit(cls: type, name: str) -> st.SearchStrategy:
    return st.sampled_from(typing.get_args(typing.get_type_hints(cls)[name]))


def _some(cls: type, **fields: st.SearchStrategy) -> st.SearchStrategy:
    """Instances of `cls` with a random subset of `fields` set, the rest left at their default."""
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


texts = st.text(max_size=12)
ints = st.integers(min_value=-(10**6), max_value=10**12)
floats = st.floats(allow_nan=False, allow_infinity=True)

sources = _some(DataSourceConfig, path=texts, weight=floats, name=texts)

configs = _some(
    Config,
    output_dir=texts,
    seed=ints,
    max_steps=ints,
    batch_size=ints,
    micro_batch_size=ints,
    seq_len=ints,
    resume=st.one_of(st.none(), st.booleans(), ints, st.just("latest")),
    trace_path=st.one_of(st.none(), texts),
    trace_steps=ints,
    model=_some(
        ModelConfig,
        name=texts,
        dtype=_lit(ModelConfig, "dtype"),
        ac=st.booleans(),
        attn_implementation=_lit(ModelConfig, "attn_implementation"),
    ),
    optim=_some(
        OptimConfig,
        name=_lit(OptimConfig, "name"),
        lr=floats,
        betas=st.tuples(floats, floats),
        eps=floats,
        weight_decay=floats,
        momentum=floats,
        max_norm=floats,
        impl=_lit(OptimConfig, "impl"),
        offload=_lit(OptimConfig, "offload"),
        keep_fp32=st.lists(texts, max_size=3).map(tuple),
    ),
    schedule=_some(
        ScheduleConfig, kind=_lit(ScheduleConfig, "kind"), warmup_steps=ints, min_lr=floats
    ),
    data=_some(
        DataConfig,
        kind=_lit(DataConfig, "kind"),
        sources=st.lists(sources, max_size=3).map(tuple),
        overlong=_lit(DataConfig, "overlong"),
        shuffle=st.booleans(),
    ),
    ckpt=_some(CkptConfig, interval=ints, keep_last=ints, save_final=st.booleans()),
    parallel=_some(
        ParallelConfig,
        dp_replicate=ints,
        dp_shard=ints,
        cp=ints,
        tp=ints,
        ep=st.one_of(ints, st.just("auto")),
    ),
    wandb=_some(WandbConfig, mode=_lit(WandbConfig, "mode"), project=texts, name=texts),
    runtime=_some(
        RuntimeConfig,
        num_threads=ints,
        matmul_precision=_lit(RuntimeConfig, "matmul_precision"),
        dist_timeout_s=floats,
        peak_tflops=floats,
    ),
)


def _same_types(a, b) -> None:
    """Equal values of equal types, recursively (True must not come back as 1, nor 1 as 1.0)."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            _same_types(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            _same_types(x, y)
    else:
        assert a == b and type(a) is type(b), (a, b)


# ---------------------------------------------------------------------------------------------
# JSON round trips


@SETTINGS
@given(configs)
def test_config_json_round_trip(config):
    text = to_json(config)
    back = from_json(Config, text)
    assert back == config
    _same_types(config, back)
    assert to_json(back) == text


@SETTINGS
@given(configs)
def test_to_json_is_strict_plain_json(config):
    plain = to_plain(config)
    assert set(plain) == {f.name for f in dataclasses.fields(Config)}
    assert isinstance(plain["data"]["sources"], list)
    assert isinstance(plain["optim"]["betas"], list)


def test_default_config_round_trips_and_validates():
    config = Config()
    assert from_json(Config, to_json(config)) == config
    validate(config, 1)


def test_every_key_has_a_docstring_and_appears_in_help():
    keys = all_keys(Config)
    missing = [k for k, (_, doc) in keys.items() if not doc]
    assert missing == []
    text = help_text()
    for key in keys:
        assert f"--{key} (" in text


def test_from_json_rejects_unknown_and_mistyped_keys():
    plain = to_plain(Config())
    plain["optim"]["lrr"] = 1.0
    with pytest.raises(ConfigError, match=r"optim\.lrr.*optim\.lr"):
        from_json(Config, json.dumps(plain))
    plain = to_plain(Config())
    plain["max_steps"] = "10"
    with pytest.raises(ConfigError, match="max_steps.*expected int"):
        from_json(Config, json.dumps(plain))


# ---------------------------------------------------------------------------------------------
# Layering: CLI > TOML > defaults


def _write(directory: str, text: str) -> str:
    path = Path(directory) / "run.toml"
    path.write_text(text)
    return str(path)


LAYERED_KEYS = {
    # dotted key: (default, strategy of values)
    "max_steps": (Config().max_steps, st.integers(1, 10**6)),
    "seed": (Config().seed, st.integers(0, 10**6)),
    "micro_batch_size": (Config().micro_batch_size, st.integers(1, 64)),
    "optim.lr": (OptimConfig().lr, st.floats(1e-9, 10.0)),
    "optim.weight_decay": (OptimConfig().weight_decay, st.floats(0.0, 1.0)),
    "schedule.warmup_steps": (ScheduleConfig().warmup_steps, st.integers(0, 1000)),
    "ckpt.keep_last": (CkptConfig().keep_last, st.integers(0, 9)),
    "runtime.dist_timeout_s": (RuntimeConfig().dist_timeout_s, st.floats(1.0, 1e4)),
}


@st.composite
def layered(draw):
    """For each key: maybe a TOML value, maybe a CLI value, a spelling and a CLI form."""
    plan = {}
    for key, (_, values) in LAYERED_KEYS.items():
        toml_value = draw(st.one_of(st.none(), values))
        cli_value = draw(st.one_of(st.none(), values))
        dashed = draw(st.booleans())
        spaced = draw(st.booleans())
        plan[key] = (toml_value, cli_value, dashed, spaced)
    return plan


def _get(config, dotted):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


@SETTINGS
@given(layered(), st.booleans())
def test_cli_beats_toml_beats_defaults(plan, toml_dashed):
    toml_lines, argv = [], []
    for key, (toml_value, cli_value, dashed, spaced) in plan.items():
        if toml_value is not None:
            toml_key = key.replace("_", "-") if toml_dashed else key
            toml_lines.append(f"{toml_key} = {toml_value!r}")
        if cli_value is not None:
            cli_key = key.replace("_", "-") if dashed else key
            argv += [f"--{cli_key}", str(cli_value)] if spaced else [f"--{cli_key}={cli_value}"]
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, "\n".join(toml_lines) + "\n")
        config, cli = load_config(["--config", path, *argv])
    assert cli.config_file == path
    for key, (toml_value, cli_value, _, _) in plan.items():
        default = LAYERED_KEYS[key][0]
        expected = (
            cli_value
            if cli_value is not None
            else toml_value
            if toml_value is not None
            else default
        )
        assert _get(config, key) == expected, key


def test_no_config_file_gives_defaults_plus_overrides():
    config, cli = load_config(["--max_steps", "3"])
    assert cli.config_file is None
    assert config == dataclasses.replace(Config(), max_steps=3)


def test_dashes_and_underscores_are_equivalent(tmp_path):
    path = _write(tmp_path, "micro-batch-size = 2\n[optim]\nweight-decay = 0.5\n")
    a, _ = load_config(["--config", path, "--max-steps=4", "--optim.keep-fp32", "norm,bias"])
    b, _ = load_config(
        [
            "--micro_batch_size",
            "2",
            "--optim.weight_decay=0.5",
            "--max_steps",
            "4",
            "--optim.keep_fp32=norm,bias",
        ]
    )
    assert a == b
    assert a.micro_batch_size == 2 and a.optim.weight_decay == 0.5 and a.max_steps == 4
    assert a.optim.keep_fp32 == ("norm", "bias")


def test_equals_and_space_forms_are_equivalent():
    a, _ = load_config(["--optim.lr=0.5", "--schedule.kind=cosine", "--model.dtype=bfloat16"])
    b, _ = load_config(
        ["--optim.lr", "0.5", "--schedule.kind", "cosine", "--model.dtype", "bfloat16"]
    )
    assert a == b
    assert (a.optim.lr, a.schedule.kind, a.model.dtype) == (0.5, "cosine", "bfloat16")


def test_bare_boolean_flag_switches_on():
    config, _ = load_config(["--model.ac", "--seed", "3"])
    assert config.model.ac is True and config.seed == 3
    config, _ = load_config(["--data.shuffle", "false"])
    assert config.data.shuffle is False


def test_cli_values_of_union_fields():
    assert load_config(["--parallel.ep", "auto"])[0].parallel.ep == "auto"
    assert load_config(["--parallel.ep", "2"])[0].parallel.ep == 2
    assert load_config(["--resume", "latest"])[0].resume == "latest"
    assert load_config(["--resume", "true"])[0].resume is True
    assert load_config(["--resume", "none"])[0].resume is None
    assert load_config(["--trace-path", "traces"])[0].trace_path == "traces"


@pytest.mark.parametrize("n", [0, 1, 2, 17])
def test_resume_step_number_means_the_same_on_cli_and_in_toml(tmp_path, n):
    """`resume = N` names checkpoint step_N (docs/design.md, 'Resume').

    `--resume N` must mean the same step, not become a bool.
    """
    from_toml, _ = load_config(["--config", _write(tmp_path, f"resume = {n}\n")])
    from_cli, _ = load_config(["--resume", str(n)])
    assert from_toml.resume == n and type(from_toml.resume) is int
    assert from_cli.resume == n and type(from_cli.resume) is int


def test_list_of_tables_from_toml_and_cli(tmp_path):
    path = _write(
        tmp_path,
        'data.kind = "sources"\n'
        '[[data.sources]]\npath = "a.jsonl"\nweight = 2\n'
        '[[data.sources]]\npath = "b.jsonl"\nname = "bee"\n',
    )
    config, _ = load_config(["--config", path])
    assert config.data.sources == (
        DataSourceConfig(path="a.jsonl", weight=2.0),
        DataSourceConfig(path="b.jsonl", name="bee"),
    )
    override = json.dumps([{"path": "c.jsonl", "weight": 0.5}])
    config, _ = load_config(["--config", path, "--data.sources", override])
    assert config.data.sources == (DataSourceConfig(path="c.jsonl", weight=0.5),)


# ---------------------------------------------------------------------------------------------
# Errors: unknown keys, wrong types


def test_unknown_cli_key_names_key_source_and_suggestion():
    with pytest.raises(ConfigError) as info:
        load_config(["--optim.lrr=1"])
    msg = str(info.value)
    assert "optim.lrr" in msg and "command line" in msg and "did you mean 'optim.lr'" in msg


def test_unknown_toml_key_names_key_file_and_suggestion(tmp_path):
    path = _write(tmp_path, "[optim]\nlrr = 1.0\n")
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path])
    msg = str(info.value)
    assert "optim.lrr" in msg and path in msg and "did you mean 'optim.lr'" in msg

    path = _write(tmp_path, "max_step = 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path])
    msg = str(info.value)
    assert "max_step" in msg and path in msg and "did you mean 'max_steps'" in msg


def test_unknown_section_names_the_leaf(tmp_path):
    path = _write(tmp_path, '[modl]\nname = "x"\n')
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path])
    msg = str(info.value)
    assert "modl.name" in msg and path in msg and "did you mean 'model.name'" in msg


def test_unknown_key_inside_a_source_table(tmp_path):
    path = _write(tmp_path, '[[data.sources]]\npath = "a.jsonl"\nwieght = 2.0\n')
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path])
    msg = str(info.value)
    assert "data.sources[0].wieght" in msg and path in msg and "weight" in msg


LEAF_KEYS = sorted(all_keys(Config))
RESERVED = {"config", "print_config", "help_config", "help"}


@st.composite
def typos(draw):
    """A known key with one letter deleted, doubled or replaced; the result is not a key."""
    key = draw(st.sampled_from(LEAF_KEYS))
    letters = [i for i, c in enumerate(key) if c.isalpha()]
    i = draw(st.sampled_from(letters))
    edit = draw(st.sampled_from(["delete", "double", "replace"]))
    if edit == "delete":
        typo = key[:i] + key[i + 1 :]
    elif edit == "double":
        typo = key[:i] + key[i] + key[i:]
    else:
        typo = key[:i] + draw(st.sampled_from("qxzjk")) + key[i + 1 :]
    parts = typo.split(".")
    known_prefixes = {k.rsplit(".", 1)[0] for k in LEAF_KEYS if "." in k}
    assume(
        typo not in LEAF_KEYS
        and typo not in RESERVED
        and typo not in known_prefixes
        and all(parts)
        and not any(typo.startswith(k + ".") for k in LEAF_KEYS)
    )
    return key, typo


@SETTINGS
@given(typos(), st.booleans())
def test_typo_of_any_key_is_reported_with_a_known_suggestion(pair, from_file):
    _, typo = pair
    with tempfile.TemporaryDirectory() as tmp:
        if from_file:
            path = _write(tmp, f"{typo} = 1\n")
            argv, source = ["--config", path], path
        else:
            argv, source = [f"--{typo}=1"], "command line"
        with pytest.raises(ConfigError) as info:
            load_config(argv)
    msg = str(info.value)
    assert typo in msg and source in msg
    match = re.search(r"did you mean '([^']+)'", msg)
    assert match, msg
    assert match.group(1) in LEAF_KEYS


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--max-steps", "abc"], "expected int"),
        (["--optim.lr", "fast"], "expected float"),
        (["--model.ac", "maybe"], "expected bool"),
        (["--optim.name", "adam"], 'expected "adamw" | "sgd"'),
        (["--optim.betas", "0.9,0.99,0.999"], "expected (float, float)"),
        (["--parallel.ep", "many"], 'expected int | "auto"'),
    ],
)
def test_wrong_cli_type_names_key_source_and_expected_type(argv, expected):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    msg = str(info.value)
    key = argv[0][2:].replace("-", "_")
    assert f"'{key}'" in msg and "command line" in msg and expected in msg


@pytest.mark.parametrize(
    "toml, key, expected",
    [
        ('max_steps = "10"\n', "max_steps", "expected int"),
        ("max_steps = 2.5\n", "max_steps", "expected int"),
        ("max_steps = true\n", "max_steps", "expected int"),
        ("[optim]\nlr = true\n", "optim.lr", "expected float"),
        ('[model]\nac = "yes"\n', "model.ac", "expected bool"),
        ('[schedule]\nkind = "step"\n', "schedule.kind", '"constant" | "linear" | "cosine"'),
        ('model = "x"\n', "model", "section"),
        ("[[data.sources]]\npath = 3\n", "data.sources[0].path", "expected str"),
    ],
)
def test_wrong_toml_type_names_key_file_and_expected_type(tmp_path, toml, key, expected):
    path = _write(tmp_path, toml)
    with pytest.raises(ConfigError) as info:
        load_config(["--config", path])
    msg = str(info.value)
    assert f"'{key}'" in msg and path in msg and expected in msg


def test_missing_and_invalid_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(["--config", str(tmp_path / "nope.toml")])
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--config", _write(tmp_path, "max_steps = = 3\n")])
    with pytest.raises(ConfigError, match="needs a value"):
        load_config(["--seed"])
    with pytest.raises(ConfigError, match="unexpected argument 'seed=3'"):
        load_config(["seed=3"])


# ---------------------------------------------------------------------------------------------
# validate(): cross-field rules


@SETTINGS
@given(
    batch=st.integers(1, 256),
    micro=st.integers(1, 16),
    shard=st.integers(1, 8),
    replicate=st.sampled_from([None, 1, 2]),
)
def test_batch_size_divisible_by_micro_batch_times_dp(batch, micro, shard, replicate):
    # Only valid plans here (cp = tp = 1), so the data-parallel size is the world size.
    world = (replicate or 1) * shard
    parallel = (
        ParallelConfig()
        if replicate is None
        else ParallelConfig(dp_replicate=replicate, dp_shard=shard)
    )
    config = Config(batch_size=batch, micro_batch_size=micro, parallel=parallel)
    if batch % (micro * world) == 0:
        validate(config, world)
    else:
        with pytest.raises(ConfigError) as info:
            validate(config, world)
        msg = str(info.value)
        assert "'batch_size'" in msg and str(micro * world) in msg


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        (ParallelConfig(tp=2), 2, r"'parallel\.tp' = 2: only 1 is implemented"),
        (ParallelConfig(cp=2, dp_shard=2), 4, r"'parallel\.cp' = 2: only 1 is implemented"),
        (ParallelConfig(dp_shard=3), 2, r"dp_shard=3 .* but the world size is 2"),
        (ParallelConfig(dp_replicate=3), 2, r"world size 2 is not divisible"),
        (ParallelConfig(dp_replicate=0), 1, r"'parallel\.dp_replicate' = 0"),
        (ParallelConfig(dp_shard=0), 1, r"'parallel\.dp_shard' = 0"),
    ],
)
def test_validate_rejects_a_bad_parallel_plan(parallel, world, message):
    """The same rules and messages as at setup (fnt.config.parallel), before any model is loaded."""
    with pytest.raises(ConfigError, match=message):
        validate(Config(batch_size=16, micro_batch_size=1, parallel=parallel), world)


@SETTINGS
@given(lr=st.floats(0.0, 1.0), min_lr=st.floats(0.0, 2.0))
def test_min_lr_must_not_exceed_lr(lr, min_lr):
    config = Config(optim=OptimConfig(lr=lr), schedule=ScheduleConfig(min_lr=min_lr))
    if min_lr <= lr:
        validate(config, 1)
    else:
        with pytest.raises(ConfigError, match=r"'schedule\.min_lr'.*optim\.lr"):
            validate(config, 1)


@pytest.mark.parametrize(
    "config, key",
    [
        (Config(data=DataConfig(kind="sources")), "'data.sources'"),
        (
            Config(data=DataConfig(kind="sources", sources=(DataSourceConfig(),))),
            "'data.sources[0].path'",
        ),
        (
            Config(
                data=DataConfig(
                    kind="sources", sources=(DataSourceConfig(path="a.jsonl", weight=0.0),)
                )
            ),
            "'data.sources[0].weight'",
        ),
        (
            Config(
                data=DataConfig(
                    kind="sources",
                    sources=(
                        DataSourceConfig(path="x/a.jsonl"),
                        DataSourceConfig(path="y/a.jsonl"),
                    ),
                )
            ),
            "'data.sources'",
        ),
        (
            Config(
                data=DataConfig(
                    kind="sources",
                    sources=(DataSourceConfig(path="a.jsonl"),),
                    loss_mask=("assistant", "bot"),
                )
            ),
            "'data.loss_mask'",
        ),
        (Config(max_steps=0), "'max_steps'"),
        # data.sources under the default kind, synthetic, trained on counting sequences unread.
        (
            Config(data=DataConfig(sources=(DataSourceConfig(path="a.jsonl"),))),
            """'data.kind' = 'synthetic': would train on synthetic counting sequences""",
        ),
        (Config(seq_len=1), "'seq_len'"),
        (Config(optim=OptimConfig(lr=-1.0)), "'optim.lr'"),
        (Config(optim=OptimConfig(eps=0.0)), "'optim.eps'"),
        (Config(optim=OptimConfig(betas=(0.9, 1.0))), "'optim.betas'"),
        (Config(schedule=ScheduleConfig(warmup_steps=-1)), "'schedule.warmup_steps'"),
        (Config(ckpt=CkptConfig(keep_last=-1)), "'ckpt.keep_last'"),
        (Config(ckpt=CkptConfig(interval=-1)), "'ckpt.interval'"),
        (Config(resume=-3), "'resume'"),
        (Config(runtime=RuntimeConfig(dist_timeout_s=0.0)), "'runtime.dist_timeout_s'"),
    ],
)
def test_validate_rejects_naming_the_key(config, key):
    with pytest.raises(ConfigError) as info:
        validate(config, 1)
    assert key in str(info.value)


def test_validate_accepts_distinct_jsonl_sources():
    sources = (
        DataSourceConfig(path="x/a.jsonl"),
        DataSourceConfig(path="y/a.jsonl", name="other", weight=3.0),
    )
    validate(Config(data=DataConfig(kind="sources", sources=sources)), 1)


# ---------------------------------------------------------------------------------------------
# The script: exit status 2 before any model is built


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sft.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=5,
    )


def test_script_unknown_key_exits_2_with_suggestion():
    result = _script("--optim.lrr=1")
    assert result.returncode == 2
    assert "optim.lrr" in result.stderr and "optim.lr'" in result.stderr
    assert "did you mean" in result.stderr


def test_script_wrong_type_exits_2_naming_int():
    result = _script("--max-steps", "abc")
    assert result.returncode == 2
    assert "max_steps" in result.stderr and "int" in result.stderr


def test_script_invalid_value_exits_2():
    result = _script("--batch-size", "6", "--micro-batch-size", "4")
    assert result.returncode == 2
    assert "batch_size" in result.stderr


def test_script_bad_parallel_plan_exits_2():
    result = _script("--parallel.dp-shard", "2")
    assert result.returncode == 2
    assert "dp_shard=2" in result.stderr and "world size is 1" in result.stderr


def test_script_print_config_exits_0_with_parseable_json(tmp_path):
    path = _write(tmp_path, "max_steps = 5\n[optim]\nlr = 0.25\n")
    result = _script("--config", path, "--print-config", "--seed", "7")
    assert result.returncode == 0, result.stderr
    printed = from_json(Config, result.stdout)
    assert printed == load_config(["--config", path, "--seed", "7"])[0]
    assert (printed.max_steps, printed.optim.lr, printed.seed) == (5, 0.25, 7)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--model.loss-chunk-tokens=-1", "'model.loss_chunk_tokens' = -1: must be >= 0"),
        ("--runtime.preempt-exit-code=0", "'runtime.preempt_exit_code' = 0: must be an exit"),
        ("--runtime.preempt-exit-code=256", "'runtime.preempt_exit_code' = 256: must be an exit"),
    ],
)
def test_loss_chunks_and_the_preemption_code_are_checked(override, message):
    config, _ = load_config([override])
    with pytest.raises(ConfigError, match=message):
        validate(config, 1)


def test_the_old_data_kind_jsonl_still_works_with_a_deprecation_line(tmp_path, capsys):
    path = _write(tmp_path, 'data.kind = "jsonl"\n[[data.sources]]\npath = "a.jsonl"\n')
    config, _ = load_config(["--config", path])
    assert config.data.kind == "sources"
    line = capsys.readouterr().err.strip()
    assert line.startswith("warning: 'data.kind' = \"jsonl\" (file ") and '"sources"' in line
    from_cli, _ = load_config(["--data.kind", "jsonl"])
    assert from_cli.data.kind == "sources"
    assert "(command line) is deprecated" in capsys.readouterr().err


def test_a_checkpoint_written_with_the_old_data_kind_resumes_under_the_new_one():
    from fnt.resume import reconcile_config

    saved = to_plain(Config(data=DataConfig(kind="sources")))
    saved["data"]["kind"] = "jsonl"  # what a checkpoint of an older fnt records
    current = to_plain(Config(data=DataConfig(kind="sources")))
    assert reconcile_config(saved, current)["data.kind"].action == "keep"
