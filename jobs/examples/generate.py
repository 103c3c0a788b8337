"""The last step of the LLM workflow: text from an exported model with transformers alone.

    python jobs/examples/generate.py runs/llama-finetuned --prompt "The checkpoint" --tokens 20

``hpc ckpt export --format hf`` wrote the model directory; the tokenizer is the example's
(``jobs/examples/tokenizer.json``) unless ``--tokenizer`` names another. Greedy decoding, so the
same model gives the same text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a directory hpc ckpt export --format hf wrote")
    parser.add_argument("--tokenizer", default=str(HERE / "tokenizer.json"))
    parser.add_argument("--prompt", default="The")
    parser.add_argument("--tokens", type=int, default=20)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(args.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(args.prompt, add_special_tokens=False).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    print(tokenizer.decode(out[0].tolist()))


if __name__ == "__main__":
    main()
