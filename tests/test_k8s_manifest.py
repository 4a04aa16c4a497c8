"""scripts/deploy/k8s/titanrl-pytorchjob.yaml: a 2-node Kubeflow PyTorchJob whose container
command is a launch that torchrun and titanrl's config loader both accept."""

import os
import re

import yaml  # PyYAML: a dependency of wandb, which titanrl depends on
from helpers.launch import REPO_ROOT
from torch.distributed.run import get_args_parser

from titanrl.cli import split_args
from titanrl.config import load_config

MANIFEST = os.path.join(REPO_ROOT, "scripts", "deploy", "k8s", "titanrl-pytorchjob.yaml")
# What the training operator (v1.7+) puts in every pod's environment, with this job's values:
# pkg/controller.v1/pytorch/envvar.go and master.go.
OPERATOR_ENV = {
    "MASTER_ADDR": "titanrl-grpo-gsm8k-master-0",
    "MASTER_PORT": "23456",
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "8",
    "PET_NODE_RANK": "0",
    "WORLD_SIZE": "16",
    "RANK": "0",
}


def _manifest() -> dict[str, dict]:
    with open(MANIFEST) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def _pods() -> dict[str, dict]:
    specs = _manifest()["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]
    return {name: spec["template"]["spec"] for name, spec in specs.items()}


def _argv(container: dict) -> list[str]:
    """The container's command line as the pod runs it: $(VAR) expanded as Kubernetes does."""
    env = {**OPERATOR_ENV, **{e["name"]: e["value"] for e in container.get("env", [])}}
    argv = [*container["command"], *container["args"]]
    unknown = {name for arg in argv for name in re.findall(r"\$\((\w+)\)", arg)} - env.keys()
    assert not unknown, f"variables neither the operator nor the pod sets: {unknown}"
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in argv]
    # `titanrl run [torchrun options] CONFIG [overrides]` runs this torchrun command line:
    assert argv[:2] == ["titanrl", "run"], argv[:2]
    opts, config_file, overrides = split_args(argv[2:])
    return ["torchrun", *opts, "-m", "titanrl.train", f"--job.config_file={config_file}", *overrides]


def test_manifest_is_a_two_node_pytorchjob_that_restarts_and_checkpoints_on_sigterm():
    docs = _manifest()
    job = docs["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert sum(spec["replicas"] for spec in specs.values()) == 2  # nodes
    assert specs["Master"]["replicas"] == 1
    claim = docs["PersistentVolumeClaim"]
    # Every rank writes its shards into one checkpoint folder: all nodes mount the same volume.
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for name, spec in specs.items():
        assert spec["restartPolicy"] == "OnFailure", name
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # where the operator looks for the master port
        assert {"name": "pytorchjob-port", "containerPort": int(OPERATOR_ENV["MASTER_PORT"])} in container["ports"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == int(job["spec"]["nprocPerNode"])
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = [
            m
            for m in container["volumeMounts"]
            if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]
        ]
        assert len(mounts) == 1, name
        cli = get_args_parser().parse_args(_argv(container)[1:])
        config = load_config(_overrides(cli.training_script_args))
        assert config.job.dump_folder.startswith(mounts[0]["mountPath"] + "/")
        assert config.checkpoint.enable
        assert cli.max_restarts >= 1
        # SIGTERM: torchrun gives the ranks shutdown_timeout s to checkpoint; the kubelet's SIGKILL
        # must come after that.
        assert "SIGTERM" in cli.signals_to_handle.split(",")
        assert pod["terminationGracePeriodSeconds"] > cli.shutdown_timeout >= 120, name


def _overrides(script_args: list[str]) -> list[str]:
    """titanrl's arguments with the config file found in this checkout (the image's workingDir)."""
    out = []
    for arg in script_args:
        assert re.fullmatch(r"--\w+\.\w+=.*", arg), f"not a --section.key=value override: {arg!r}"
        key, value = arg.split("=", 1)
        if key == "--job.config_file":
            assert value.startswith("train_configs/") and os.path.isfile(os.path.join(REPO_ROOT, value)), value
            value = os.path.join(REPO_ROOT, value)
        out.append(f"{key}={value}")
    return out


def test_manifest_command_is_the_slurm_launch_and_titanrl_accepts_it():
    pods = _pods()
    argvs = {name: _argv(pod["containers"][0]) for name, pod in pods.items()}
    assert argvs["Master"] == argvs["Worker"]  # one command; the rendezvous assigns node ranks
    argv = argvs["Master"]
    assert argv[0] == "torchrun"
    cli = get_args_parser().parse_args(argv[1:])  # an unknown or misspelt option exits here
    assert cli.module and cli.training_script == "titanrl.train"
    assert (cli.nnodes, cli.nproc_per_node) == (OPERATOR_ENV["PET_NNODES"], OPERATOR_ENV["PET_NPROC_PER_NODE"])
    # As scripts/deploy/multinode_trainer.slurm: c10d rendezvous on the first node, a stable id, so that
    # a restarted pod rejoins the same job.
    assert cli.rdzv_backend == "c10d"
    assert cli.rdzv_endpoint == f"{OPERATOR_ENV['MASTER_ADDR']}:{OPERATOR_ENV['MASTER_PORT']}"
    assert cli.rdzv_id == _manifest()["PyTorchJob"]["metadata"]["name"]
    config = load_config(_overrides(cli.training_script_args))  # every override is a known key
    p = config.parallelism
    world_size = int(cli.nnodes) * int(cli.nproc_per_node)
    assert p.dp_replicate * p.dp_shard * p.tp == world_size
    assert p.dp_shard * p.tp == int(cli.nproc_per_node)  # FSDP and TP stay inside a node
