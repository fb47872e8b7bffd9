"""Build a tiny random-weight Llama with a ChatML tokenizer, for real vLLM on CPU.

Run it with the vLLM environment's interpreter (it needs torch, transformers, tokenizers):

    .venv-vllm/bin/python deploy/local/build_tiny_model.py [--out DIR]

The tokenizer is a byte-level BPE (about 8k tokens) trained on the Python standard library's own
sources, so no network is needed. The model is a 2-layer Llama (5.4M parameters, bf16) with fixed
random weights: its output is gibberish, but vLLM serves it with real batching, prefix caching
and metrics. The build goes to a temporary sibling directory that is renamed into place, and the
marker file is written last, so a directory holding the marker is always a complete model and a
second run is a no-op.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# deploy/local/localpool.py checks for the same name before it launches this script.
MARKER = "TINY_MODEL_COMPLETE"

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / ".cache" / "tiny-llama"

VOCAB_SIZE = 8192
TRAINING_TEXT_BYTES = 4 * 1024 * 1024
SEED = 1234

PAD, IM_START, IM_END = "<|pad|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Skipped: third-party packages, and directories of generated or binary-ish test data.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def is_complete(out: Path) -> bool:
    return (out / MARKER).is_file()


def stdlib_sources(limit_bytes: int) -> Iterator[str]:
    """Yield the text of standard-library modules, in a stable order, up to limit_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not _SKIPPED_DIRS.intersection(p.relative_to(root).parts)
    )
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= limit_bytes:
            return
    if total == 0:
        raise SystemExit(f"no Python sources found under {root} to train the tokenizer on")


def build_tokenizer(out: Path) -> int:
    """Train and save the tokenizer; return its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, IM_START, IM_END],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_sources(TRAINING_TEXT_BYTES), trainer=trainer)

    # transformers leaves some constructors unannotated (and mis-types Module.to).
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=tokenizer,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=PAD,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return int(tokenizer.get_vocab_size())


def build_model(out: Path, vocab_size: int) -> int:
    """Create and save the random-weight model; return its parameter count."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call,unused-ignore]
    model = model.to(torch.bfloat16)  # type: ignore[arg-type,unused-ignore]
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out))
    generation = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # type: ignore[no-untyped-call,unused-ignore]
    generation.save_pretrained(str(out))
    return int(sum(p.numel() for p in model.parameters()))


def build(out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        started = time.monotonic()
        vocab_size = build_tokenizer(staging)
        params = build_model(staging, vocab_size)
        (staging / MARKER).write_text(f"vocab={vocab_size} params={params} seed={SEED}\n")
        if is_complete(out):  # another build won the race; keep its result
            return
        if out.exists():  # an incomplete leftover from an interrupted build
            shutil.rmtree(out)
        staging.chmod(0o755)  # mkdtemp makes it private
        os.replace(staging, out)
        print(
            f"built {out}: vocab {vocab_size}, {params / 1e6:.1f}M parameters, "
            f"{time.monotonic() - started:.1f} s"
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--force", action="store_true", help="rebuild even if already complete")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    if is_complete(out) and not args.force:
        print(f"tiny model already built: {out}")
        return 0
    if args.force and out.exists():
        shutil.rmtree(out)
    build(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
