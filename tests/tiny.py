"""Tiny seeded random models of every supported family, built in-process (no network), with a tiny tokenizer; and
the seeded token ids and toy artifact costs several test files share."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eectl.contracts.plan import Costs


def _find_gsm8k() -> Path:
    """The GSM8K training split the project's tests read (never copied into the project): $EECTL_GSM8K, else
    ../shared/data/gsm8k/train.jsonl beside the checkout, else the workplace's /work/shared copy."""
    rel = Path("data") / "gsm8k" / "train.jsonl"
    candidates = [os.environ.get("EECTL_GSM8K"), Path(__file__).resolve().parents[2] / "shared" / rel]
    candidates.append(Path("/work/shared") / rel)
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    raise FileNotFoundError("GSM8K train.jsonl not found: set EECTL_GSM8K to its path")


GSM8K = _find_gsm8k()

_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# model_type -> (config class name, extra config). Sliding windows are small so tests cross them.
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": 16}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "query_pre_attn_scalar": 16,
            "final_logit_softcapping": 30.0,
        },
    ),
}

TRAIN_TEXT = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? 48/2 = 24 clips in May. #### 72",
    "def add(a, b):\n    return a + b\n",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
] * 8


def tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE trained in-process on a few lines: deterministic, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_model(model_type: str, seed: int = 0):
    import transformers

    cls_name, extra = TINY_CONFIGS[model_type]
    config = getattr(transformers, cls_name)(**{**_COMMON, **extra})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Random init leaves logits nearly flat; scale weights up so top-1 is decisive and layers differ.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(4.0)
    return model.eval()


def save_tiny(model_type: str, folder: Path, seed: int = 0) -> Path:
    model = tiny_model(model_type, seed)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def random_ids(seed: int, n: int, vocab: int) -> list[int]:
    """n seeded random token ids in [3, vocab) (clear of the tiny tokenizer's special ids)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def toy_costs(**kw: object) -> Costs:
    """The measured costs of a toy artifact of three 4-layer segments (L = 12, exits after 4 and 8), with no
    unexplained overhead (12 ms of segments + 3 ms of head = the 15 ms full step); `kw` overrides fields."""
    base: dict[str, object] = dict(
        provider="cpu",
        threads=1,
        past=128,
        repeats=5,
        embed_ms=0.0,
        segment_ms=[4.0, 4.0, 4.0],
        segment_extra_ms=[0.5, 0.5, 0.5],
        kv_ms=[1.0, 1.0, 1.0],
        final_head_ms=3.0,
        final_head_extra_ms=0.2,
        candidates_ms={"4": 0.3, "8": 0.3},
        local_ms={"4": 0.05, "8": 0.05},
        full_step_ms=15.0,
    )
    base.update(kw)
    return Costs(**base)
