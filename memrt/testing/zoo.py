"""Real model code from Hugging Face ``transformers`` (random init, small configs, synthetic data).

Each entry builds a model, a batch maker and the model's own activation checkpointing, so that tests
and benchmarks train the very code users run: GPT-2, Llama (rotary embeddings passed to every layer,
grouped-query attention), BERT for sequence classification (padded batches with attention masks),
T5 (an encoder-decoder: decoder layers read the encoder's output, layer 0 computes the position bias
the next layers take), ViT (a vision transformer over image patches) and ConvNeXt (a convolutional vision
model with stochastic depth, built of stages of layers). Dropout is on where the
config has it. Nothing is downloaded (``HF_HUB_OFFLINE=1`` is fine). Sizes: ``tiny`` (the suite),
``small`` (benchmarks).

``transformers`` is imported lazily: ``pip install "memrt[test]"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["ZooCase", "ZOO", "budget_fractions", "build", "checkpoint_units", "names", "padded_batch"]


@dataclass(kw_only=True)
class ZooCase:
    """One model with its data."""

    name: str
    model: nn.Module
    """The model (training mode), initialised from the seed given to :func:`build`."""
    batch: Callable[[int], dict[str, torch.Tensor]]
    """``batch(step)`` -> the keyword arguments of one training forward (labels included)."""
    checkpoint: Callable[[nn.Module, int], None]
    """``checkpoint(model, every_n)``: the model's own activation checkpointing of every n-th layer (ConvNeXt
    has none in transformers: ``torch.utils.checkpoint`` of every n-th stage)."""
    description: str = ""

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        return model(**self.batch(step)).loss


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError('the model zoo needs transformers: pip install "memrt[test]"') from exc
    transformers.logging.set_verbosity_error()
    return transformers


def _hf_checkpoint(model: nn.Module, every_n: int) -> None:
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                          every_n_layers=every_n)


def checkpoint_units(model: nn.Module, every_n: int = 1) -> None:
    """Checkpoint every ``every_n``-th of memrt's default units with ``torch.utils.checkpoint``
    (non-reentrant), for models that have no checkpointing of their own."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from memrt.memory.units import find_units

    for i, (_, m) in enumerate(find_units(model)):
        if i % every_n:
            continue
        original = m.forward

        def forward(*args: Any, _f=original, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _f(*args, **kwargs)
            return checkpoint(functools.partial(_f, **kwargs), *args, use_reentrant=False)

        m.forward = forward


def _tokens(vocab: int, batch: int, seq: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(2, vocab, (batch, seq), generator=g)


_SIZES = {
    # name: (layers, width, heads, sequence, batch)
    "tiny": (4, 128, 4, 128, 4),
    "small": (6, 256, 4, 256, 8),
}


def _gpt2(size: str) -> ZooCase:
    t = _transformers()
    layers, width, heads, seq, batch = _SIZES[size]
    cfg = t.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=1024, n_positions=seq,
                       bos_token_id=1, eos_token_id=1)
    model = t.GPT2LMHeadModel(cfg)

    def make(step: int) -> dict[str, torch.Tensor]:
        ids = _tokens(cfg.vocab_size, batch, seq, step)
        return {"input_ids": ids, "labels": ids}

    return ZooCase(name="gpt2", model=model, batch=make, checkpoint=_hf_checkpoint,
                   description=f"GPT2LMHeadModel {layers}x{width}, {heads} heads, {batch}x{seq} tokens, dropout 0.1")


def _llama(size: str) -> ZooCase:
    t = _transformers()
    layers, width, heads, seq, batch = _SIZES[size]
    cfg = t.LlamaConfig(hidden_size=width, intermediate_size=width * 8 // 3, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), vocab_size=1024,
                        max_position_embeddings=seq, attention_dropout=0.1, pad_token_id=0)
    model = t.LlamaForCausalLM(cfg)

    def make(step: int) -> dict[str, torch.Tensor]:
        ids = _tokens(cfg.vocab_size, batch, seq, step)
        return {"input_ids": ids, "labels": ids}

    return ZooCase(name="llama", model=model, batch=make, checkpoint=_hf_checkpoint,
                   description=f"LlamaForCausalLM {layers}x{width}, {heads} heads / {cfg.num_key_value_heads} kv "
                               f"heads, rotary, {batch}x{seq} tokens, attention dropout 0.1")


def _bert(size: str) -> ZooCase:
    t = _transformers()
    layers, width, heads, seq, batch = _SIZES[size]
    cfg = t.BertConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=4 * width, vocab_size=1024, max_position_embeddings=seq, num_labels=3)
    model = t.BertForSequenceClassification(cfg)

    def make(step: int) -> dict[str, torch.Tensor]:
        ids = _tokens(cfg.vocab_size, batch, seq, step)
        lengths = torch.tensor([seq - (i * seq) // (2 * batch) for i in range(batch)])  # padded batch
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        ids = ids * mask  # pad token 0 after each sequence's end
        labels = torch.randint(0, 3, (batch,), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return ZooCase(name="bert", model=model, batch=make, checkpoint=_hf_checkpoint,
                   description=f"BertForSequenceClassification {layers}x{width}, padded {batch}x{seq} with "
                               "attention masks, dropout 0.1")


def _t5(size: str) -> ZooCase:
    t = _transformers()
    layers, width, heads, seq, batch = _SIZES[size]
    cfg = t.T5Config(d_model=width, d_ff=2 * width, d_kv=width // heads, num_layers=layers - 1,
                     num_decoder_layers=layers - 1, num_heads=heads, vocab_size=1024, dropout_rate=0.1,
                     decoder_start_token_id=0)
    model = t.T5ForConditionalGeneration(cfg)

    def make(step: int) -> dict[str, torch.Tensor]:
        src = _tokens(cfg.vocab_size, batch, seq, step)
        tgt = _tokens(cfg.vocab_size, batch, seq // 2, step + 500)
        return {"input_ids": src, "labels": tgt}

    return ZooCase(name="t5", model=model, batch=make, checkpoint=_hf_checkpoint,
                   description=f"T5ForConditionalGeneration {layers - 1}+{layers - 1} layers x{width}, "
                               f"{batch}x{seq} -> {seq // 2} tokens, dropout 0.1")


def _convnext(size: str) -> ZooCase:
    t = _transformers()
    width = 32 if size == "tiny" else 48
    image, batch = (64, 8) if size == "tiny" else (96, 16)
    cfg = t.ConvNextConfig(hidden_sizes=[width, 2 * width, 4 * width, 8 * width], depths=[2, 2, 4, 2],
                           image_size=image, num_labels=10, drop_path_rate=0.1)
    model = t.ConvNextForImageClassification(cfg)

    def make(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + step)
        return {"pixel_values": torch.randn(batch, 3, image, image, generator=g),
                "labels": torch.randint(0, 10, (batch,), generator=g)}

    return ZooCase(name="convnext", model=model, batch=make, checkpoint=checkpoint_units,
                   description=f"ConvNextForImageClassification widths {cfg.hidden_sizes}, depths {cfg.depths}, "
                               f"{batch}x3x{image}x{image}, stochastic depth 0.1")


def _vit(size: str) -> ZooCase:
    t = _transformers()
    layers, width, heads, _, batch = _SIZES[size]
    image, patch = (64, 8) if size == "tiny" else (96, 8)
    cfg = t.ViTConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=4 * width, image_size=image, patch_size=patch, num_labels=10,
                      hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = t.ViTForImageClassification(cfg)

    def make(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(3000 + step)
        return {"pixel_values": torch.randn(2 * batch, 3, image, image, generator=g),
                "labels": torch.randint(0, 10, (2 * batch,), generator=g)}

    return ZooCase(name="vit", model=model, batch=make, checkpoint=_hf_checkpoint,
                   description=f"ViTForImageClassification {layers} layers x{width}, {2 * batch}x3x{image}x{image} "
                               f"({(image // patch) ** 2 + 1} tokens), dropout 0.1")


ZOO: dict[str, Callable[[str], ZooCase]] = {
    "gpt2": _gpt2, "llama": _llama, "bert": _bert, "t5": _t5, "vit": _vit, "convnext": _convnext,
}


def names() -> list[str]:
    return list(ZOO)


def budget_fractions(name: str) -> tuple[float, ...]:
    """Where the zoo's 3 budgets lie between the model's own checkpointing of every layer (0) and none (1)."""
    return (0.25, 0.5, 0.75)


def build(name: str, size: str = "tiny", *, seed: int = 0) -> ZooCase:
    """The zoo entry ``name`` at ``size`` ('tiny' or 'small'), weights from ``seed`` (the caller's
    generators are left as they were)."""
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}: expected one of {', '.join(ZOO)}")
    if size not in _SIZES:
        raise ValueError(f"unknown zoo size {size!r}: expected one of {', '.join(_SIZES)}")
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        case = ZOO[name](size)
    case.model.train()
    return case


def padded_batch(step: int, length: int, *, batch: int, vocab: int) -> dict[str, torch.Tensor]:
    """What a padding collator gives a causal LM: ``batch`` sequences padded to the longest (row 0, ``length``
    tokens), attention masks, -100 labels on the padding; drawn from a private generator seeded by ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(2, vocab, (batch, length), generator=g)
    lens = torch.randint(max(1, length // 2), length + 1, (batch,), generator=g)
    lens[0] = length
    mask = (torch.arange(length)[None] < lens[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
