"""Run the fault / bad-input tests and write the table of docs/reliability.md from their results.

Each such test has a docstring '<fault or bad input> -> <observed behaviour>'. The table lists
them with the test's name and its result in this run.

    python scripts/reliability_table.py            # print the table
    python scripts/reliability_table.py --update-docs
    python scripts/reliability_table.py --update-docs --only tests/test_async.py   # rerun these files' tests;
                                                   # the other rows keep their result from the docs
"""

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [
    "tests/test_reliability.py",
    "tests/test_checkpoint.py",
    "tests/test_tasks_rewards.py",
    "tests/test_train.py",
    "tests/test_config.py",
    "tests/test_generator.py",
    "tests/test_envs.py",
    "tests/test_recipes.py",
    "tests/test_trainer.py",
    "tests/test_reward_isolation.py",
    "tests/test_launch_hygiene.py",
    "tests/test_metrics.py",
    "tests/test_data_validation.py",
    "tests/test_checkpoint_resharding.py",
    "tests/test_checkpoint_integrity.py",
    "tests/test_env_servers.py",
    "tests/test_verifiers_env.py",
    "tests/test_moe_generator_ep.py",
    "tests/test_async.py",
    "tests/test_fault_tolerance.py",
]
START, END = "<!-- reliability:start -->", "<!-- reliability:end -->"


def fault_tests() -> dict[str, tuple[str, str]]:
    """{'file::name': (fault, behaviour)} for test functions with an arrow docstring."""
    found = {}
    for path in FILES:
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and "->" in doc:
                fault, behaviour = (part.strip() for part in " ".join(doc.split()).split("->", 1))
                found[f"{path}::{node.name}"] = (fault, behaviour)
    return found


def run(tests: list[str]) -> dict[str, str]:
    if not tests:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        subprocess.run([sys.executable, "-m", "pytest", "-q", f"--junitxml={xml}", *tests], cwd=ROOT)
        results = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name").split("[")[0]
            failed = any(child.tag in ("failure", "error") for child in case)
            if name not in results or failed:
                results[name] = "fail" if failed else "pass"
        return results


def documented_results() -> dict[str, str]:
    """{test name: result} of the table in docs/reliability.md now."""
    text = open(os.path.join(ROOT, "docs", "reliability.md")).read()
    table = text.partition(START)[2].partition(END)[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("|") and line.endswith("|")]
    return {row[-3].strip().strip("`"): row[-2].strip() for row in rows[2:]}  # past the header rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update-docs", action="store_true", help="rewrite the table in docs/reliability.md")
    parser.add_argument("--only", nargs="+", default=[], metavar="FILE", help="run only these files' tests")
    args = parser.parse_args()
    tests = fault_tests()
    results = {**documented_results(), **run([t for t in tests if not args.only or t.split("::")[0] in args.only])}
    rows = ["| fault or bad input | observed behaviour | test | result |", "|---|---|---|---|"]
    for node, (fault, behaviour) in tests.items():
        name = node.split("::")[1]
        rows.append(f"| {fault} | {behaviour} | `{name}` | {results.get(name, 'not run')} |")
    table = "\n".join(rows)
    print(table)
    if args.update_docs:
        path = os.path.join(ROOT, "docs", "reliability.md")
        text = open(path).read()
        head, _, rest = text.partition(START)
        _, _, tail = rest.partition(END)
        open(path, "w").write(f"{head}{START}\n{table}\n{END}{tail}")


if __name__ == "__main__":
    main()
