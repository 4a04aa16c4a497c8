"""Convert a titanrl checkpoint (DCP, any number of saving ranks) to a Hugging Face folder.

    python scripts/convert_to_hf.py --job.config_file train_configs/X.toml \
        --checkpoint outputs/X/checkpoint/step-100 --out outputs/X/hf-step-100 [--dtype bfloat16]

The job config names the model (flavor or hf_checkpoint) the checkpoint was trained from; the
output (config.json + safetensors, sharded past 5 GB) loads with transformers.
"""

import argparse
import os

import torch
import torch.distributed.checkpoint as dcp

from titanrl.config import load_config
from titanrl.models.flavors import get_model_args
from titanrl.models.hf import export_hf, read_hf_config
from titanrl.models.model import Transformer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a step-N folder written by titanrl")
    parser.add_argument("--out", required=True, help="output Hugging Face folder")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    args, rest = parser.parse_known_args(argv)
    config = load_config(rest)
    if not os.path.exists(os.path.join(args.checkpoint, ".metadata")):
        raise SystemExit(f"'{args.checkpoint}' is not a complete titanrl checkpoint (no .metadata)")
    model_args = (
        read_hf_config(config.model.hf_checkpoint)
        if config.model.hf_checkpoint
        else get_model_args(config.model.flavor)
    )
    if config.model.max_seq_len:
        model_args.max_seq_len = config.model.max_seq_len
    model = Transformer(model_args)
    model.init_weights()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=args.checkpoint, no_dist=True)
    model.load_state_dict(state["model"])
    export_hf(model, args.out, dtype=_DTYPES[args.dtype])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
