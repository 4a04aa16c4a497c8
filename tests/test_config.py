"""Config loading: TOML + CLI precedence, strict validation, docstrings, round-trips."""

import dataclasses
import glob
import os
import typing

import pytest
from helpers.launch import REPO_ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.algorithms import ALGORITHMS, validate_algorithm
from titanrl.config import JobConfig, help_text, load_config, to_toml
from titanrl.config.job_config import section_fields
from titanrl.config.manager import field_docs, parse_cli_args


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_validate():
    config = load_config([])
    assert config == JobConfig()


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = _write(tmp_path, "[training]\nsteps = 7\nbatch_size = 4\n[optimizer]\nlr = 0.5\n")
    config = load_config(["--job.config_file", path, "--training.steps=9", "--optimizer.beta1", "0.8"])
    assert config.training.steps == 9  # CLI wins
    assert config.training.batch_size == 4  # from TOML
    assert config.optimizer.lr == 0.5  # from TOML
    assert config.optimizer.beta1 == 0.8  # CLI, space-separated form
    assert config.training.max_norm == JobConfig().training.max_norm  # default


def test_typo_key_in_toml_names_key_and_suggestion(tmp_path):
    path = _write(tmp_path, "[training]\nstesp = 3\n")
    with pytest.raises(ValueError, match=r"Unknown config key 'training.stesp' in .*job.toml\. Did you mean 'steps'\?"):
        load_config([f"--job.config_file={path}"])


def test_typo_section_and_cli_key():
    with pytest.raises(ValueError, match=r"Unknown config section \[trainig\].*Did you mean 'training'"):
        load_config(["--trainig.steps=3"])
    with pytest.raises(ValueError, match=r"'optimizer.learning_rate'.*Valid keys of \[optimizer\]: name, lr"):
        load_config(["--optimizer.learning_rate=3"])


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--training.steps=ten"], r"Invalid value 'ten' for 'training.steps': expected int"),
        (["--compile.enable=maybe"], r"Invalid value 'maybe' for 'compile.enable': expected bool"),
        (["--optimizer.name=adamw"], r"expected one of 'AdamW', 'Adam', 'SGD'\. Did you mean 'AdamW'"),
        (["--optimizer.lr=0"], r"\[optimizer\] lr must be > 0, got 0.0"),
        (["--parallelism.dp_shard=0"], r"dp_shard must be >= 1 or -1"),
        (
            ["--training.micro_batch_tokens=64", "--model.max_seq_len=128"],
            r"micro_batch_tokens \(64\) is below one sequence",
        ),
        (
            ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=x"],
            r"selective_ac_option must be 'op' or a positive integer",
        ),
        (["--data.task=jsonl"], r"task = 'jsonl' has moved: data.path alone selects file data"),
        (["training.steps=3"], r"Unexpected argument 'training.steps=3'"),
        (["--steps=3"], r"must name a section and a key"),
        # Incompatible algorithm options fail at load, naming the fix.
        (["--algorithm.name=ppo"], r"'ppo' needs a value model: add \[critic\] with enable = true"),
        (["--critic.enable=true"], r"algorithm 'grpo' uses no critic; use 'ppo'"),
        (["--algorithm.name=gspo", "--algorithm.loss_agg=token-mean"], r"set loss_agg = 'seq-mean-token-mean'"),
        (["--algorithm.name=rloo", "--algorithm.group_size=1"], r"'rloo' needs group_size >= 2"),
        (
            ["--algorithm.name=ppo", "--critic.enable=true", "--rollout.dynamic_sampling=true"],
            r"dynamic_sampling .* not for 'ppo'",
        ),
        (["--algorithm.off_policy_correction=iss"], r"expected one of 'none', 'tis', 'mis'"),
        (["--algorithm.is_cap=0.5"], r"is_cap must be > 1"),
        (["--algorithm.name=ppo", "--critic.enable=true", "--algorithm.ppo.lam=1.5"], r"lam must be in \[0, 1\]"),
        # Settings that moved name their new place; an algorithm's own table is checked like a section.
        (["--algorithm.lam=0.9"], r"'algorithm.lam' in the command line has moved: set \[algorithm.ppo\] lam"),
        (["--algorithm.sapo_tau_pos=1"], r"has moved: set \[algorithm.sapo\] tau_pos"),
        (["--algorithm.dynamic_sampling=true"], r"has moved: set \[rollout\] dynamic_sampling"),
        (["--algorithm.normalize_std=false"], r"has moved: set \[algorithm.<name>\] normalize_std"),
        (["--algorithm.grpo.normalise_std=false"], r"'algorithm.grpo.normalise_std'. Did you mean 'normalize_std'"),
        (["--algorithm.grpo.normalize_std=maybe"], r"Invalid value 'maybe' for 'algorithm.grpo.normalize_std'"),
        (["--algorithm.sapo.tau_pos=1"], r"\[algorithm.sapo\] is set but algorithm.name is 'grpo'"),
        (["--algorithm.name=sapo", "--algorithm.sapo.tau_neg=0"], r"\[algorithm.sapo\] tau_neg must be > 0"),
        (["--algorithm.name=rloo", "--algorithm.rloo.x=1"], r"'algorithm.rloo.x'. It takes no settings"),
        (["--reward.verifier_weight=0"], r"nothing gives a reward"),
        (["--job.recipe=ppo"], r"expected one of 'rl', 'sft', 'dpo', 'reward_model'"),
        (["--data.task=calculator"], r"task 'calculator' is multi-turn: set env.name = 'calculator'"),
        (["--env.name=calculator", "--reward.function=m:f"], r"the environment's steps give the rewards"),
        (["--env.max_turns=0"], r"\[env\] max_turns must be >= 1"),
        (["--dpo.label_smoothing=0.5"], r"label_smoothing must be in \[0, 0.5\)"),
        (["--rollout.partial=true"], r"set algorithm.off_policy_correction = 'tis'"),
        (
            ["--rollout.partial=true", "--algorithm.off_policy_correction=tis", "--rollout.dynamic_sampling=true"],
            r"partial = true and rollout.dynamic_sampling cannot be combined",
        ),
        (
            [
                "--rollout.partial=true",
                "--algorithm.off_policy_correction=tis",
                "--data.task=calculator",
                "--env.name=calculator",
            ],
            r"partial = true does not support multi-turn",
        ),
        (["--rollout.oversample=0.5"], r"oversample must be >= 1"),
        (
            ["--rollout.mode=one_step"],
            r"set algorithm.off_policy_correction = 'tis' \(or 'mis'\), or rollout.staleness = 0",
        ),
        (["--rollout.mode=one_step", "--rollout.staleness=2"], r"staleness must be 0 or 1"),
        (
            ["--rollout.mode=one_step", "--rollout.staleness=0", "--parallelism.tp=2"],
            r"'one_step' does not support parallelism.tp > 1 yet",
        ),
    ],
)
def test_invalid_values_are_clear_errors(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_algorithm(load_config(args))


def test_algorithm_table_from_toml_and_cli(tmp_path):
    """[algorithm.sapo] in TOML, one key overridden on the command line -> the algorithm reads both,
    typed; the resolved config records every setting of the table and reloads to the same config"""
    path = _write(tmp_path, '[algorithm]\nname = "sapo"\n[algorithm.sapo]\ntau_pos = 0.5\n')
    config = load_config([f"--job.config_file={path}", "--algorithm.sapo.tau_neg=2"])
    validate_algorithm(config)
    assert config.algorithm.tables == {"sapo": {"normalize_std": True, "tau_pos": 0.5, "tau_neg": 2.0}}
    settings_ = ALGORITHMS["sapo"](config.algorithm).settings
    assert (settings_.tau_pos, settings_.tau_neg) == (0.5, 2.0)
    (tmp_path / "resolved.toml").write_text(to_toml(config))
    loaded = load_config([f"--job.config_file={tmp_path / 'resolved.toml'}"])
    assert (loaded.algorithm, loaded.training) == (config.algorithm, config.training)


def test_wrong_toml_type_and_malformed_toml(tmp_path):
    """Wrong value type, malformed TOML, missing config file -> ValueError naming the key or file and what is expected"""
    path = _write(tmp_path, '[training]\nsteps = "3"\n')
    with pytest.raises(ValueError, match=r"Invalid value '3' for 'training.steps': expected int"):
        load_config([f"--job.config_file={path}"])
    path = _write(tmp_path, "[training\nsteps = 3\n")
    with pytest.raises(ValueError, match=r"is not valid TOML"):
        load_config([f"--job.config_file={path}"])
    with pytest.raises(ValueError, match=r"does not exist"):
        load_config(["--job.config_file=/nonexistent/x.toml"])


def test_bool_flag_without_value():
    assert load_config(["--compile.enable", "--job.deterministic=false"]).compile.enable is True


def test_every_field_has_a_docstring_and_help_lists_it():
    text = help_text()
    for section in section_fields():
        cls = section.default_factory
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{section.name}.{f.name} has no docstring"
            assert f"--{section.name}.{f.name} " in text or f"[{section.name}.<name>]" in text
    for cls in ALGORITHMS.values():
        docs = field_docs(cls.Settings)
        for f in dataclasses.fields(cls.Settings):
            assert docs.get(f.name, "").strip(), f"[algorithm.{cls.name}] {f.name} has no docstring"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO_ROOT, "train_configs", "*.toml"))))
def test_shipped_configs_load(path):
    validate_algorithm(load_config([f"--job.config_file={path}"]))


# Property tests: any valid config survives TOML and CLI round-trips unchanged.
def _value_strategy(tp):
    args = typing.get_args(tp)
    if type(None) in args:  # optional (generator.compile: unset is "by device")
        return st.none() | _value_strategy(next(a for a in args if a is not type(None)))
    if typing.get_origin(tp) is typing.Literal:
        return st.sampled_from(typing.get_args(tp))
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(min_value=1, max_value=10**6)
    if tp is float:
        return st.floats(min_value=1e-6, max_value=0.9, allow_nan=False)
    if tp is str:
        return st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12)
    if typing.get_origin(tp) is list:  # names (lora.target_modules, float8.filter_fqns)
        return st.lists(st.text("abcdefgw0123_", min_size=1, max_size=6), min_size=1, max_size=3)
    raise AssertionError(tp)


@st.composite
def _configs(draw):
    config = JobConfig()
    for section in section_fields():
        obj = getattr(config, section.name)
        for name, tp in typing.get_type_hints(type(obj)).items():
            if name != "tables" and draw(st.booleans()):
                # algorithm.name is free text checked against the registry: draw registered names.
                registered = (section.name, name) == ("algorithm", "name")
                setattr(obj, name, draw(st.sampled_from(list(ALGORITHMS)) if registered else _value_strategy(tp)))
    config.job.config_file = ""  # naming a file would load it
    return config


def _is_valid(config: JobConfig) -> bool:
    try:
        config.validate()
        validate_algorithm(config)
        return True
    except ValueError:
        return False


@settings(max_examples=60, deadline=None)
@given(_configs())
def test_toml_roundtrip(tmp_path_factory, config):
    if not _is_valid(config):
        return
    path = tmp_path_factory.mktemp("rt") / "c.toml"
    path.write_text(to_toml(config), encoding="utf-8")
    loaded = load_config([f"--job.config_file={path}"])
    loaded.job.config_file = ""
    assert loaded == config


@settings(max_examples=60, deadline=None)
@given(_configs())
def test_cli_roundtrip(config):
    if not _is_valid(config):
        return
    args = []
    for section in section_fields():
        for key, value in dataclasses.asdict(getattr(config, section.name)).items():
            if key == "tables":
                args += [f"--{section.name}.{t}.{k}={v}" for t, table in value.items() for k, v in table.items()]
            else:
                args.append(f"--{section.name}.{key}={value}")
    loaded = load_config(args)
    validate_algorithm(loaded)  # types the algorithm's own table, given as text on the command line
    assert loaded == config


def test_parse_cli_args_forms():
    assert parse_cli_args(["--a.b=1", "--c.d", "2", "--e.f"]) == {"a": {"b": "1"}, "c": {"d": "2"}, "e": {"f": "true"}}


def test_text_settings_from_the_command_line_write_valid_toml(tmp_path):
    """A text (Literal) setting of an algorithm's table given on the command line -> the resolved
    config is valid TOML that reloads to the same settings (before and after validation)"""
    args = ["--algorithm.name=reinforce_pp", "--algorithm.reinforce_pp.baseline=group"]
    config = load_config(args)
    for stage in ("raw", "validated"):
        if stage == "validated":
            validate_algorithm(config)
        path = tmp_path / f"{stage}.toml"
        path.write_text(to_toml(config))
        loaded = load_config([f"--job.config_file={path}"])
        validate_algorithm(loaded)
        assert loaded.algorithm.tables["reinforce_pp"]["baseline"] == "group"


def test_user_module_failing_at_import_names_file_and_line(tmp_path, monkeypatch):
    """Plug-in module (algorithm, environment, reward) that raises at import, any exception, or imports a missing dependency -> ValueError naming the config key, file:line and the exception"""
    from titanrl.components.plugins import load_object

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "attr_at_import.py").write_text("import os\n\nPATH = os.no_such_thing\n")
    (tmp_path / "missing_dep.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ValueError) as e:
        load_object("attr_at_import:Env", "env.name")
    assert str(e.value).startswith(
        f"env.name 'attr_at_import:Env': importing 'attr_at_import' failed at {tmp_path / 'attr_at_import.py'}:3: "
        "AttributeError: module 'os' has no attribute 'no_such_thing'"
    )
    with pytest.raises(ValueError, match=r"algorithm.name 'missing_dep:X' cannot be imported \(No module named"):
        load_object("missing_dep:X", "algorithm.name")
    with pytest.raises(ValueError, match=r"reward.function 'os:no_such_fn' cannot be imported"):
        load_object("os:no_such_fn", "reward.function")
