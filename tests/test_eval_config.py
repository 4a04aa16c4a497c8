"""[[eval]] suites in the config: TOML arrays of tables, validation, CLI overrides by suite name,
the to_toml round trip, --help and the generated reference."""

import dataclasses

import pytest

from titanrl.config import help_text, load_config, to_toml
from titanrl.config.evaluation import EvalSuite

SUITES = """
[data]
task = "reverse"

[[eval]]
name = "rev"
task = "reverse"
num_samples = 8
k = 4
temperature = 1.0

[[eval]]
name = "gsm8k"
preset = "gsm8k"
num_samples = 5
prompt_template = "{prompt}\\nPut the final answer in \\\\boxed{}."
chat_template = true
system_prompt = "Be brief."
"""


def _load(tmp_path, text: str, *cli: str):
    path = tmp_path / "job.toml"
    path.write_text(text, encoding="utf-8")
    return load_config([f"--job.config_file={path}", *cli])


def test_suites_are_read_in_order_with_their_types(tmp_path):
    config = _load(tmp_path, SUITES)
    assert [s.name for s in config.eval] == ["rev", "gsm8k"]
    rev, gsm8k = config.eval
    assert (rev.task, rev.num_samples, rev.k, rev.temperature) == ("reverse", 8, 4, 1.0)
    assert gsm8k.preset == "gsm8k" and gsm8k.chat_template is True and gsm8k.system_prompt == "Be brief."
    assert gsm8k.prompt_template == "{prompt}\nPut the final answer in \\boxed{}."
    assert rev.chat_template is None and rev.system_prompt is None  # none: as [data]


def test_no_suites_keeps_the_default_job(tmp_path):
    assert _load(tmp_path, "[data]\ntask = 'reverse'\n").eval == []


def test_to_toml_round_trip(tmp_path):
    config = _load(tmp_path, SUITES, "--eval.gsm8k.k=8", "--eval.gsm8k.temperature=0.7")
    text = to_toml(config)
    assert text.count("[[eval]]") == 2
    again = _load(tmp_path, text)
    again.job.config_file = config.job.config_file
    assert again == config


def test_cli_overrides_a_suite_by_name(tmp_path):
    config = _load(tmp_path, SUITES, "--eval.gsm8k.k=8", "--eval.gsm8k.temperature=0.7", "--eval.rev.top_p=0.9")
    rev, gsm8k = config.eval
    assert (gsm8k.k, gsm8k.temperature, rev.top_p) == (8, 0.7, 0.9)
    assert rev.k == 4  # the other suite's keys stay
    config = _load(tmp_path, SUITES, "--eval.gsm8k.chat_template=none")
    assert config.eval[1].chat_template is None


@pytest.mark.parametrize(
    ("cli", "match"),
    [
        (["--eval.gsm9k.k=8"], r"Unknown eval suite 'gsm9k'.*Did you mean 'gsm8k'\? Suites: rev, gsm8k"),
        (["--eval.gsm8k=8"], r"must name a suite and a key"),
        (["--eval.gsm8k.kk=8"], r"Unknown config key 'eval.gsm8k.kk'.*Did you mean 'k'"),
        (["--eval.gsm8k.k=eight"], r"Invalid value 'eight' for 'eval.gsm8k.k': expected int"),
        (["--eval.gsm8k.k=8"], r"'gsm8k': k = 8 samples of a greedy decoder.*temperature > 0"),
    ],
)
def test_cli_override_errors(tmp_path, cli, match):
    with pytest.raises(ValueError, match=match):
        _load(tmp_path, SUITES, *cli)


def test_cli_override_without_suites_says_how_to_declare_them(tmp_path):
    with pytest.raises(ValueError, match=r"Suites: none \(declare suites as \[\[eval\]\] tables"):
        _load(tmp_path, "[data]\ntask = 'reverse'\n", "--eval.gsm8k.k=8")


def _suite(**fields) -> str:
    body = "\n".join(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in fields.items())
    return f"[[eval]]\n{body}\n"


@pytest.mark.parametrize(
    ("tables", "match"),
    [
        (_suite(task="reverse", num_samples=4), r"every suite needs a name"),
        (_suite(name="a b", task="reverse", num_samples=4), r"name may hold only letters"),
        (_suite(name="a", num_samples=4), r"'a': set exactly one of path, task and preset \(got none of them\)"),
        (_suite(name="a", path="x.jsonl", preset="gsm8k"), r"exactly one of .* \(got path and preset\)"),
        (_suite(name="a", task="reverse"), r"set num_samples > 0"),
        (_suite(name="a", preset="gsm8k", num_samples=-1), r"num_samples must be >= 0"),
        (_suite(name="a", preset="gsm8k", k=0), r"k \(samples per prompt\) must be >= 1, got 0"),
        (_suite(name="a", preset="gsm8k", k=4), r"set temperature > 0 or k = 1"),
        (_suite(name="a", preset="gsm8k", top_p=0.0), r"top_p must be in \(0, 1\]"),
        (_suite(name="a", preset="gsm8k", prompt_template="Q:"), r"must contain '\{prompt\}'"),
        (_suite(name="a", preset="gsm8k", reward="mod.fn"), r"reward must be 'module:callable'"),
        (_suite(name="a", preset="gsm8k", system_prompt="x", chat_template=False), r"system_prompt needs a chat"),
        (_suite(name="a", preset="gsmk8"), r"Invalid value 'gsmk8' for 'eval.a.preset'.*Did you mean 'gsm8k'"),
        (_suite(name="a", preset="gsm8k", kk=1), r"Unknown config key 'eval.a.kk'"),
        (_suite(name="a", preset="gsm8k") + _suite(name="a", preset="aime2025"), r"two suites are named 'a'"),
        ("[eval]\nname = 'a'\n", r"must be an array of tables, one \[\[eval\]\] per suite"),
    ],
)
def test_invalid_suites_are_clear_errors(tmp_path, tables, match):
    with pytest.raises(ValueError, match=match):
        _load(tmp_path, tables)


def test_help_and_reference_list_every_suite_key():
    text = help_text()
    assert "[[eval]]" in text
    for f in dataclasses.fields(EvalSuite):
        assert f"\n  {f.name}  (" in text
    from scripts.gen_config_docs import render

    page = render()
    assert "## [[eval]]" in page
    assert all(f"| `{f.name}` |" in page for f in dataclasses.fields(EvalSuite))
