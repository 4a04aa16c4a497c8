"""The `titanrl` command line: --help and --version on every command, `titanrl cp` to fork a
recipe, `job.recipe` naming a user's Recipe subclass, a forked recipe trained with `titanrl run`,
and a user error raised mid-run printed as one line with its traceback in a file."""

import json
import logging
import os
import subprocess
import sys
import tempfile

import pytest
from helpers.launch import REPO_ROOT, run_cmd

from titanrl import __version__, cli
from titanrl.components import launch
from titanrl.components.checkpoint import CheckpointSaveError
from titanrl.config import load_config
from titanrl.recipes import RECIPES, get_recipe

DEBUG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
TINY = [
    "--sft_warmup.steps=0",
    "--training.batch_size=4",
    "--algorithm.group_size=2",
    "--generator.max_new_tokens=4",
    "--data.num_eval_samples=4",
    "--reward.num_workers=1",
    "--metrics.eval_freq=0",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(REPO_ROOT, "tests")}
ENV.pop("TITANRL_FAULT", None)


@pytest.mark.parametrize(
    "argv, usage",
    [
        (["--help"], "usage: titanrl [-h] [--version] COMMAND"),
        ([], "usage: titanrl [-h] [--version] COMMAND"),
        (["run", "--help"], "usage: titanrl run [--nproc N] [torchrun options] CONFIG.toml"),
        (["run", "-h"], "usage: titanrl run [--nproc N] [torchrun options] CONFIG.toml"),
        (["run", "--nproc", "2", DEBUG, "--help"], "usage: titanrl run [--nproc N]"),
        (["eval", "--help"], "usage: titanrl eval CONFIG.toml [--checkpoint PATH | --hf FOLDER]"),
        (["serve-env", "--help"], "usage: titanrl serve-env"),
        (["cp", "--help"], "usage: titanrl cp [-h] {dpo,reward_model,rl,sft} DEST.py"),
    ],
)
def test_help_on_every_command_prints_usage_and_exits_0(argv, usage, capsys):
    """`titanrl [COMMAND] --help`: the command's usage and options on stdout, exit code 0"""
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(usage), out
    assert "options:" in out


def test_version_and_help_through_the_installed_entry_points():
    """`titanrl --version` prints the package's version; `titanrl run --help` and
    `python -m titanrl.train --help` exit 0 in a fresh interpreter"""
    version = run_cmd([sys.executable, "-m", "titanrl.cli", "--version"], ENV, timeout_s=120)
    assert version.returncode == 0 and version.stdout.strip() == f"titanrl {__version__}", version
    helped = run_cmd([sys.executable, "-m", "titanrl.cli", "run", "--help"], ENV, timeout_s=120)
    assert helped.returncode == 0 and "usage: titanrl run" in helped.stdout and not helped.stderr
    keys = run_cmd([sys.executable, "-m", "titanrl.train", "--help"], ENV, timeout_s=120)
    assert keys.returncode == 0 and "job.recipe" in keys.stdout, keys.stderr[-2000:]


def test_unknown_command_and_missing_config_exit_2(capsys):
    assert cli.main(["trian"]) == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err
    assert cli.main(["run", "--nproc", "2"]) == 2
    assert "no CONFIG.toml given" in capsys.readouterr().err


def test_overrides_and_torchrun_options_pass_through_unchanged():
    """Everything before the .toml goes to torchrun, everything after it to the config manager, in order"""
    opts, config_file, overrides = cli.split_args(
        ["--nproc", "2", "--nnodes", "1", DEBUG, "--training.steps=3", "--optimizer.lr", "0.5"]
    )
    assert config_file == DEBUG and overrides == ["--training.steps=3", "--optimizer.lr", "0.5"]
    assert opts[:3] == ["--nproc_per_node=2", "--nnodes", "1"]
    config = load_config([f"--job.config_file={config_file}", *overrides])
    assert config.training.steps == 3 and config.optimizer.lr == 0.5


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_cp_copies_a_recipe_and_a_config_naming_the_copy(name, tmp_path, capsys):
    """`titanrl cp NAME DEST.py`: DEST.py is the built-in recipe's file, DEST.toml its config with
    job.recipe = 'DEST.py' (found beside the config), the copy's class loads; a second cp refuses"""
    dest = tmp_path / f"my_{name}.py"
    assert cli.main(["cp", name, str(dest)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {dest}" in out and f"wrote {tmp_path / f'my_{name}.toml'}" in out
    with open(sys.modules[RECIPES[name].__module__].__file__) as f:
        assert dest.read_text() == f.read()
    config = load_config([f"--job.config_file={tmp_path / f'my_{name}.toml'}"])
    assert config.job.recipe == f"my_{name}.py"
    forked = get_recipe(config.job.recipe, config.job.config_file)
    assert forked is not RECIPES[name] and forked.__name__ == RECIPES[name].__name__
    assert cli.main(["cp", name, str(dest)]) == 2
    assert "exists" in capsys.readouterr().err


def test_job_recipe_that_is_not_a_recipe_is_a_one_line_error(tmp_path):
    """job.recipe naming a missing file, a missing class, a module that fails at import, or an
    object that is not a Recipe subclass -> one-line ValueError naming it"""
    (tmp_path / "broken_recipe.py").write_text("import math\nraise RuntimeError('no GPU here')\n")
    (tmp_path / "two_recipes.py").write_text(
        "from titanrl.recipes.base import Recipe\nclass A(Recipe):\n    pass\nclass B(Recipe):\n    pass\n"
    )
    cases = {
        str(tmp_path / "missing.py"): "no file",
        f"{tmp_path / 'two_recipes.py'}:C": "has no attribute 'C'",
        str(tmp_path / "broken_recipe.py"): "broken_recipe.py:2: RuntimeError: no GPU here",
        str(tmp_path / "two_recipes.py"): "defines A, B",
        "titanrl.config:JobConfig": "not a subclass of titanrl.recipes.base.Recipe",
        "titanrl.no_such_module:Recipe": "No module named 'titanrl.no_such_module'",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError) as failure:
            get_recipe(spec)
        assert message in str(failure.value) and len(str(failure.value).splitlines()) == 1, str(failure.value)
    assert get_recipe(f"{tmp_path / 'two_recipes.py'}:B").__name__ == "B"
    with pytest.raises(ValueError, match=r"expected one of 'rl', 'sft', 'dpo', 'reward_model'.*Did you mean 'sft'"):
        load_config([f"--job.config_file={DEBUG}", "--job.recipe=sfd"])


def test_forked_rl_recipe_runs_with_titanrl_run(tmp_path):
    """The RL recipe forked out of the tree (`titanrl cp rl`), its step changed to log one more
    metric, trained 2 steps with `titanrl run` from another directory -> the metric is in
    metrics.jsonl on every RL step"""
    fork = tmp_path / "fork"
    fork.mkdir()
    assert cli.main(["cp", "rl", str(fork / "my_rl.py")]) == 0
    source = (fork / "my_rl.py").read_text()
    step = "    def step(self, batches: Iterator, step: int) -> dict[str, float]:\n"
    assert source.count(step) == 1
    changed = (
        "    def step(self, batches: Iterator, step: int) -> dict[str, float]:\n"
        "        return {**self.step_in_tree(batches, step), 'forked_step': float(step)}\n\n"
        "    def step_in_tree(self, batches: Iterator, step: int) -> dict[str, float]:\n"
    )
    (fork / "my_rl.py").write_text(source.replace(step, changed))
    dump = tmp_path / "run"
    proc = run_cmd(
        [sys.executable, "-m", "titanrl.cli", "run", str(fork / "my_rl.toml"), f"--job.dump_folder={dump}"]
        + [*TINY, "--training.steps=2"],
        ENV,
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    steps = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["forked_step"] for r in steps] == [1.0, 2.0]


def test_user_error_in_a_run_is_one_line_naming_its_traceback_file(tmp_path, capsys):
    """A user error class raised inside `errors_logged` -> its traceback appended to
    <dump>/errors.log and one stderr line naming the cause and that file"""
    with pytest.raises(CheckpointSaveError) as failure:
        with launch.errors_logged(str(tmp_path)):
            raise CheckpointSaveError("cannot write the step 2 checkpoint to 'x': no free space left on the device")
    launch.report_user_error(failure.value)
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "titanrl: error: cannot write the step 2 checkpoint to 'x': no free space left on the device "
        f"(traceback in {tmp_path / 'errors.log'})"
    )
    assert "Traceback" in (tmp_path / "errors.log").read_text()
    with pytest.raises(KeyError):  # not a user error: left to the traceback
        with launch.errors_logged(str(tmp_path)):
            raise KeyError("bug")
    assert (tmp_path / "errors.log").read_text().count("Traceback") == 1


@pytest.fixture
def small_dump_folder():
    """A real 60 MiB tmpfs: one checkpoint of the debug model with its optimizer (38 MiB) fits, two do not."""
    folder = tempfile.mkdtemp()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", folder], capture_output=True)
    if mounted.returncode != 0:
        os.rmdir(folder)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", folder], check=True)
        os.rmdir(folder)


def test_disk_full_at_a_save_is_one_line_with_the_traceback_in_a_file(small_dump_folder):
    """Dump folder on a real tmpfs too small for the second checkpoint, `titanrl run` -> exit 2 and
    one stderr line naming the cause ('no free space left'), the folder and <dump>/errors.log,
    which holds the traceback (before: a 20-line [rank0] traceback and torchrun's failure line)"""
    dump = os.path.join(small_dump_folder, "run")
    args = [*TINY, "--training.steps=2", "--checkpoint.enable=true", "--checkpoint.interval=1"]
    proc = run_cmd(
        [sys.executable, "-m", "titanrl.cli", "run", DEBUG, f"--job.dump_folder={dump}", *args], ENV, timeout_s=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    log = os.path.join(dump, "errors.log")
    assert lines[0].startswith("titanrl: error: cannot write the step 2 checkpoint to"), lines[0]
    assert "no free space left" in lines[0] and lines[0].endswith(f"(traceback in {log})"), lines[0]
    assert "Traceback" in open(log).read() and "CheckpointSaveError" in open(log).read()


def test_console_output_goes_through_the_titanrl_logger(capsys):
    """Console lines are the message alone (INFO on stdout, warnings and STDERR notices on
    stderr); the standard library silences them"""
    from titanrl.rl.evaluation import progress_report

    logger = logging.getLogger("titanrl.components.metrics")
    logger.info("step    1 | reward 0.5")
    progress_report("rev", 2, 1e-9)([1, 2])
    captured = capsys.readouterr()
    assert captured.out == "step    1 | reward 0.5\n"
    assert captured.err.startswith("eval 'rev': 2/2 samples finished on rank 0")
    titanrl_logger = logging.getLogger("titanrl")
    level = titanrl_logger.level
    titanrl_logger.setLevel(logging.WARNING)
    try:
        logger.info("step    2 | reward 0.5")
        logger.warning("titanrl: SIGTERM received")
    finally:
        titanrl_logger.setLevel(level)
    assert capsys.readouterr() == ("", "titanrl: SIGTERM received\n")
