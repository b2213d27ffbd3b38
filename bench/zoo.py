"""Model zoo: reproducible ONNX exports of the models Kiln is benchmarked on.

Every model is built from a config object in code with random weights (seeded
with ``torch.manual_seed(SEED)``); nothing is downloaded.  Each model comes in
two sizes:

* ``full``: the published architecture (batch 1, sequence 128, 224x224 images),
  exported on demand to ``bench/models/<name>.onnx`` (git-ignored).
* ``tiny``: the same architecture shrunk to 2 layers / 2 blocks and small
  widths (sequence 16, 32x32 images), committed as test fixtures under
  ``tests/fixtures/zoo/<name>.onnx`` (each well under 1 MB).

All models are exported with the TorchScript exporter
(``torch.onnx.export(..., dynamo=False)``) at opset 14 with constant folding and
static shapes.  That exporter keeps LayerNorm and GELU decomposed into
primitive ops (ReduceMean/Sub/Pow/Sqrt/Div, Erf/Mul/Add), as in the DNNFusion
paper's graphs; it works for every model here in torch 2.13, so the dynamo
exporter is not used.

Inputs (all static, batch 1):

* BERT-family encoders: ``input_ids`` and ``attention_mask``, int64 ``[1, S]``.
* GPT-2: ``input_ids``, int64 ``[1, S]``.
* Vision models: ``pixel_values``, float32 ``[1, 3, H, W]``.
* LSTM: ``x``, float32 ``[S, 1, F]`` (sequence-first, the torch.nn.LSTM default);
  its output is the top layer's hidden sequence ``[S, 1, hidden]``.

Deviations from a plain export, each for a cleaner or valid graph:

* 1-D parameters (biases, norm scales/shifts) get N(0, 0.02) noise added and
  batch-norm statistics are randomized: fresh models have all-zero biases and
  unit norms, which makes every bias add a no-op and lets the exporter merge
  equal initializers into Identity nodes.  (ALBERT still has Identity nodes:
  its 12 layers share weights whose folded transposes are deduplicated.)
* GPT-2 gets an implicit all-ones attention mask (see ``HFExportWrapper``).
* MobileNetV2 uses symmetric Conv padding (``tf_padding=False``, as in
  torchvision) instead of a Pad before each conv.
* EfficientNet keeps its TF-style Pad ops; the exporter cannot fold their
  ``pads`` computation (ConstantOfShape/Concat/Slice/...), so Kiln's constant
  folding has to, and it declares symbolic output dims, which are replaced by
  the static spec shapes.

Every export is checked before it is kept: ``onnx.checker.check_model``,
strict ``onnx.shape_inference.infer_shapes``, declared output shapes, and an
onnxruntime run compared against the torch output.

CLI::

    python bench/zoo.py [--size full|tiny|all] [--models name,name] [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn
from transformers import (
    AlbertConfig,
    AlbertModel,
    BertConfig,
    BertModel,
    ConvNextConfig,
    ConvNextModel,
    DistilBertConfig,
    DistilBertModel,
    EfficientNetConfig,
    EfficientNetModel,
    GPT2Config,
    GPT2Model,
    MobileBertConfig,
    MobileBertModel,
    MobileNetV2Config,
    MobileNetV2Model,
    PreTrainedConfig,
    PreTrainedModel,
    ResNetConfig,
    ResNetModel,
    SwinConfig,
    SwinModel,
    ViTConfig,
    ViTModel,
)

SEED = 0
OPSET = 14
SIZES = ("full", "tiny")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIRS = {
    "full": REPO_ROOT / "bench" / "models",
    "tiny": REPO_ROOT / "tests" / "fixtures" / "zoo",
}
# onnxruntime must match torch within ATOL + RTOL * max|torch output|.
ATOL = 1e-4
RTOL = 1e-4

InputKind = Literal["token_ids", "mask", "float"]


@dataclass(frozen=True)
class TensorSpec:
    """A static graph input or output; ``dtype`` is a numpy dtype name.

    ``kind`` says how to make a valid random input: ``token_ids`` are drawn
    from ``[0, vocab_size)``, ``mask`` is all ones, ``float`` is standard normal.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: InputKind = "float"
    vocab_size: int | None = None


@dataclass(frozen=True)
class ZooVariant:
    """One size of a zoo model: how to build it and its graph signature."""

    build: Callable[[], nn.Module]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class ZooModel:
    name: str
    description: str
    full: ZooVariant
    tiny: ZooVariant

    def variant(self, size: str) -> ZooVariant:
        _check_size(size)
        return self.full if size == "full" else self.tiny


@dataclass(frozen=True)
class ExportReport:
    name: str
    size: str
    path: Path
    seconds: float
    max_abs_diff: float


@dataclass(frozen=True)
class GraphStats:
    file_bytes: int
    node_count: int
    op_histogram: collections.Counter[str]


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")


class HFExportWrapper(nn.Module):
    """Calls a transformers model with positional tensors and returns a tuple.

    The TorchScript exporter passes inputs positionally, while transformers
    models take keyword arguments and return ``ModelOutput`` objects.  With
    ``implicit_mask`` an all-ones ``attention_mask`` is passed along with the
    ``input_ids``: without one, transformers' causal-mask code probes
    ``position_ids`` for packed sequences with ``torch.diff``, which the
    TorchScript exporter cannot export.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        input_names: Sequence[str],
        output_names: Sequence[str],
        implicit_mask: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.implicit_mask = implicit_mask

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kwargs = dict(zip(self.input_names, inputs, strict=True))
        if self.implicit_mask:
            kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
        result = self.model(**kwargs)
        return tuple(getattr(result, name) for name in self.output_names)


class LSTMSequence(nn.Module):
    """A multi-layer LSTM returning only its output sequence."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(x)
        return output


# --- registry helpers -------------------------------------------------------


def _hf_variant(
    model_class: type[PreTrainedModel],
    config_class: type[PreTrainedConfig],
    config: Mapping[str, Any],
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    implicit_mask: bool = False,
) -> ZooVariant:
    def build() -> nn.Module:
        model = model_class(config_class(**config))
        names = [spec.name for spec in inputs]
        return HFExportWrapper(model, names, [spec.name for spec in outputs], implicit_mask)

    return ZooVariant(build, inputs, outputs)


def _text_inputs(seq: int, vocab_size: int, with_mask: bool = True) -> tuple[TensorSpec, ...]:
    ids = TensorSpec("input_ids", (1, seq), "int64", "token_ids", vocab_size)
    if not with_mask:
        return (ids,)
    return ids, TensorSpec("attention_mask", (1, seq), "int64", "mask")


def _image_inputs(image_size: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec("pixel_values", (1, 3, image_size, image_size), "float32"),)


def _sequence_outputs(seq: int, hidden: int, pooled: bool) -> tuple[TensorSpec, ...]:
    last = TensorSpec("last_hidden_state", (1, seq, hidden), "float32")
    if not pooled:
        return (last,)
    return last, TensorSpec("pooler_output", (1, hidden), "float32")


def _feature_map_outputs(channels: int, side: int, flat_pooler: bool) -> tuple[TensorSpec, ...]:
    pooled_shape = (1, channels) if flat_pooler else (1, channels, 1, 1)
    return (
        TensorSpec("last_hidden_state", (1, channels, side, side), "float32"),
        TensorSpec("pooler_output", pooled_shape, "float32"),
    )


def _text_model(
    model_class: type[PreTrainedModel],
    config_class: type[PreTrainedConfig],
    config: Mapping[str, Any],
    *,
    vocab: int,
    seq: int,
    hidden: int,
    pooled: bool = True,
    with_mask: bool = True,
) -> ZooVariant:
    return _hf_variant(
        model_class,
        config_class,
        {**config, "vocab_size": vocab, "attn_implementation": "eager"},
        _text_inputs(seq, vocab, with_mask),
        _sequence_outputs(seq, hidden, pooled),
        implicit_mask=not with_mask,
    )


def _bert(*, hidden: int, layers: int, heads: int, intermediate: int, vocab: int, seq: int) -> ZooVariant:
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
    }
    return _text_model(BertModel, BertConfig, config, vocab=vocab, seq=seq, hidden=hidden)


def _distilbert(*, hidden: int, layers: int, heads: int, intermediate: int, vocab: int, seq: int) -> ZooVariant:
    config = {"dim": hidden, "n_layers": layers, "n_heads": heads, "hidden_dim": intermediate}
    return _text_model(DistilBertModel, DistilBertConfig, config, vocab=vocab, seq=seq, hidden=hidden, pooled=False)


def _albert(
    *, hidden: int, embedding: int, layers: int, heads: int, intermediate: int, vocab: int, seq: int
) -> ZooVariant:
    config = {
        "embedding_size": embedding,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
    }
    return _text_model(AlbertModel, AlbertConfig, config, vocab=vocab, seq=seq, hidden=hidden)


def _mobilebert(
    *,
    hidden: int,
    embedding: int,
    bottleneck: int,
    layers: int,
    heads: int,
    intermediate: int,
    vocab: int,
    seq: int,
) -> ZooVariant:
    config = {
        "hidden_size": hidden,
        "embedding_size": embedding,
        "intra_bottleneck_size": bottleneck,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
    }
    return _text_model(MobileBertModel, MobileBertConfig, config, vocab=vocab, seq=seq, hidden=hidden)


def _gpt2(*, hidden: int, layers: int, heads: int, vocab: int, positions: int, seq: int) -> ZooVariant:
    config = {
        "n_embd": hidden,
        "n_layer": layers,
        "n_head": heads,
        "n_positions": positions,
        "use_cache": False,
        # GPT-2's <|endoftext|> is the last token of the vocabulary.
        "bos_token_id": vocab - 1,
        "eos_token_id": vocab - 1,
    }
    return _text_model(
        GPT2Model, GPT2Config, config, vocab=vocab, seq=seq, hidden=hidden, pooled=False, with_mask=False
    )


def _vit(*, hidden: int, layers: int, heads: int, intermediate: int, image: int, patch: int) -> ZooVariant:
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        "image_size": image,
        "patch_size": patch,
        "attn_implementation": "eager",
    }
    tokens = (image // patch) ** 2 + 1  # patches plus the [CLS] token
    return _hf_variant(
        ViTModel, ViTConfig, config, _image_inputs(image), _sequence_outputs(tokens, hidden, pooled=True)
    )


def _resnet(*, embedding: int, hidden_sizes: list[int], depths: list[int], image: int) -> ZooVariant:
    config = {"embedding_size": embedding, "hidden_sizes": hidden_sizes, "depths": depths}
    # Stem (stride 2) + max-pool (stride 2), then every stage after the first halves the map.
    side = image // 4 // 2 ** (len(depths) - 1)
    outputs = _feature_map_outputs(hidden_sizes[-1], side, flat_pooler=False)
    return _hf_variant(ResNetModel, ResNetConfig, config, _image_inputs(image), outputs)


def _convnext(*, hidden_sizes: list[int], depths: list[int], image: int) -> ZooVariant:
    config = {"hidden_sizes": hidden_sizes, "depths": depths, "num_stages": len(depths), "image_size": image}
    # Patchify stem (stride 4), then every stage after the first halves the map.
    side = image // 4 // 2 ** (len(depths) - 1)
    outputs = _feature_map_outputs(hidden_sizes[-1], side, flat_pooler=True)
    return _hf_variant(ConvNextModel, ConvNextConfig, config, _image_inputs(image), outputs)


def _swin(*, embed_dim: int, depths: list[int], heads: list[int], window: int, image: int, patch: int) -> ZooVariant:
    config = {
        "embed_dim": embed_dim,
        "depths": depths,
        "num_heads": heads,
        "window_size": window,
        "image_size": image,
        "patch_size": patch,
    }
    # Patch embedding, then every stage after the first merges 2x2 patches and doubles the width.
    side = image // patch // 2 ** (len(depths) - 1)
    hidden = embed_dim * 2 ** (len(depths) - 1)
    outputs = _sequence_outputs(side * side, hidden, pooled=True)
    return _hf_variant(SwinModel, SwinConfig, config, _image_inputs(image), outputs)


def _efficientnet(config: Mapping[str, Any], *, image: int, hidden_dim: int, downsampling: int) -> ZooVariant:
    outputs = _feature_map_outputs(hidden_dim, image // downsampling, flat_pooler=True)
    config = {**config, "image_size": image, "hidden_dim": hidden_dim}
    return _hf_variant(EfficientNetModel, EfficientNetConfig, config, _image_inputs(image), outputs)


def _mobilenetv2(config: Mapping[str, Any], *, image: int, last_channels: int) -> ZooVariant:
    outputs = _feature_map_outputs(last_channels, image // 32, flat_pooler=True)
    config = {**config, "image_size": image}
    return _hf_variant(MobileNetV2Model, MobileNetV2Config, config, _image_inputs(image), outputs)


def _lstm(*, input_size: int, hidden: int, layers: int, seq: int) -> ZooVariant:
    return ZooVariant(
        build=lambda: LSTMSequence(input_size, hidden, layers),
        inputs=(TensorSpec("x", (seq, 1, input_size), "float32"),),
        outputs=(TensorSpec("output", (seq, 1, hidden), "float32"),),
    )


FULL_SEQ = 128
TINY_SEQ = 16
FULL_IMAGE = 224
TINY_IMAGE = 32
BERT_VOCAB = 30522
TINY_VOCAB = 512

# EfficientNet-B0: the default block table with width and depth coefficient 1.0.
_EFFICIENTNET_B0 = {"width_coefficient": 1.0, "depth_coefficient": 1.0, "dropout_rate": 0.2}
# Two MBConv blocks (one per stage) at half width; the head conv is round_filters(1280) = 640.
_EFFICIENTNET_TINY = {
    "width_coefficient": 0.5,
    "depth_coefficient": 1.0,
    "kernel_sizes": [3, 5],
    "in_channels": [32, 16],
    "out_channels": [16, 24],
    "strides": [1, 2],
    "num_block_repeats": [1, 1],
    "expand_ratios": [1, 6],
}
# Symmetric Conv padding (as in torchvision) instead of TF "SAME" padding, which
# would export as a separate Pad plus an unfolded pads computation per conv.
_MOBILENETV2_FULL = {"tf_padding": False}
# MobileNetV2's 17 blocks are fixed by the architecture; shrink the widths instead.
_MOBILENETV2_TINY = {**_MOBILENETV2_FULL, "depth_multiplier": 0.25, "expand_ratio": 2.0, "finegrained_output": False}

MODELS: dict[str, ZooModel] = {
    model.name: model
    for model in (
        ZooModel(
            "bert-base",
            "BERT-base encoder: 12 layers, hidden 768, 12 heads",
            full=_bert(hidden=768, layers=12, heads=12, intermediate=3072, vocab=BERT_VOCAB, seq=FULL_SEQ),
            tiny=_bert(hidden=32, layers=2, heads=2, intermediate=64, vocab=TINY_VOCAB, seq=TINY_SEQ),
        ),
        ZooModel(
            "distilbert",
            "DistilBERT-base: 6 layers, hidden 768, 12 heads",
            full=_distilbert(hidden=768, layers=6, heads=12, intermediate=3072, vocab=BERT_VOCAB, seq=FULL_SEQ),
            tiny=_distilbert(hidden=32, layers=2, heads=2, intermediate=64, vocab=TINY_VOCAB, seq=TINY_SEQ),
        ),
        ZooModel(
            "albert",
            "ALBERT-base-v2: 12 layers sharing one set of weights, hidden 768, embedding 128",
            full=_albert(hidden=768, embedding=128, layers=12, heads=12, intermediate=3072, vocab=30000, seq=FULL_SEQ),
            tiny=_albert(hidden=32, embedding=16, layers=2, heads=2, intermediate=64, vocab=TINY_VOCAB, seq=TINY_SEQ),
        ),
        ZooModel(
            "mobilebert",
            "MobileBERT: 24 bottleneck layers, hidden 512, bottleneck 128, 4 FFNs per layer, NoNorm",
            full=_mobilebert(
                hidden=512,
                embedding=128,
                bottleneck=128,
                layers=24,
                heads=4,
                intermediate=512,
                vocab=BERT_VOCAB,
                seq=FULL_SEQ,
            ),
            tiny=_mobilebert(
                hidden=32,
                embedding=16,
                bottleneck=16,
                layers=2,
                heads=2,
                intermediate=32,
                vocab=TINY_VOCAB,
                seq=TINY_SEQ,
            ),
        ),
        ZooModel(
            "tinybert",
            "TinyBERT (BERT architecture): 4 layers, hidden 312, intermediate 1200, 12 heads",
            full=_bert(hidden=312, layers=4, heads=12, intermediate=1200, vocab=BERT_VOCAB, seq=FULL_SEQ),
            tiny=_bert(hidden=48, layers=2, heads=6, intermediate=96, vocab=TINY_VOCAB, seq=TINY_SEQ),
        ),
        ZooModel(
            "gpt2",
            "GPT-2 124M decoder: 12 layers, hidden 768, 12 heads (no KV cache)",
            full=_gpt2(hidden=768, layers=12, heads=12, vocab=50257, positions=1024, seq=FULL_SEQ),
            tiny=_gpt2(hidden=32, layers=2, heads=2, vocab=TINY_VOCAB, positions=32, seq=TINY_SEQ),
        ),
        ZooModel(
            "vit-base",
            "ViT-base/16 at 224x224: 12 layers, hidden 768",
            full=_vit(hidden=768, layers=12, heads=12, intermediate=3072, image=FULL_IMAGE, patch=16),
            tiny=_vit(hidden=32, layers=2, heads=2, intermediate=64, image=TINY_IMAGE, patch=8),
        ),
        ZooModel(
            "resnet50",
            "ResNet-50: bottleneck stages of depth 3, 4, 6, 3",
            full=_resnet(embedding=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3], image=FULL_IMAGE),
            tiny=_resnet(embedding=8, hidden_sizes=[16, 32], depths=[1, 1], image=TINY_IMAGE),
        ),
        ZooModel(
            "convnext-t",
            "ConvNeXt-T at 224x224: stages of depth 3, 3, 9, 3, widths 96-768",
            full=_convnext(hidden_sizes=[96, 192, 384, 768], depths=[3, 3, 9, 3], image=FULL_IMAGE),
            tiny=_convnext(hidden_sizes=[8, 16], depths=[1, 1], image=TINY_IMAGE),
        ),
        ZooModel(
            "swin-t",
            "Swin-T at 224x224: window 7, stages of depth 2, 2, 6, 2, embedding 96",
            full=_swin(embed_dim=96, depths=[2, 2, 6, 2], heads=[3, 6, 12, 24], window=7, image=FULL_IMAGE, patch=4),
            # Two blocks in the first stage, so the second one has shifted windows (and their mask).
            tiny=_swin(embed_dim=16, depths=[2, 1], heads=[2, 2], window=4, image=TINY_IMAGE, patch=4),
        ),
        ZooModel(
            "efficientnet-b0",
            "EfficientNet-B0: width and depth coefficient 1.0, 16 MBConv blocks",
            full=_efficientnet(_EFFICIENTNET_B0, image=FULL_IMAGE, hidden_dim=1280, downsampling=32),
            tiny=_efficientnet(_EFFICIENTNET_TINY, image=TINY_IMAGE, hidden_dim=640, downsampling=4),
        ),
        ZooModel(
            "mobilenetv2",
            "MobileNetV2 1.0 at 224x224: 17 inverted-residual blocks",
            full=_mobilenetv2(_MOBILENETV2_FULL, image=FULL_IMAGE, last_channels=1280),
            tiny=_mobilenetv2(_MOBILENETV2_TINY, image=TINY_IMAGE, last_channels=320),
        ),
        ZooModel(
            "lstm",
            "2-layer torch.nn.LSTM, input 256, hidden 512, sequence-first",
            full=_lstm(input_size=256, hidden=512, layers=2, seq=FULL_SEQ),
            tiny=_lstm(input_size=16, hidden=32, layers=2, seq=TINY_SEQ),
        ),
    )
}


# --- public API --------------------------------------------------------------


def input_specs(name: str, size: str = "full") -> tuple[TensorSpec, ...]:
    return MODELS[name].variant(size).inputs


def output_specs(name: str, size: str = "full") -> tuple[TensorSpec, ...]:
    return MODELS[name].variant(size).outputs


def make_inputs(name: str, size: str = "full", seed: int = SEED) -> dict[str, np.ndarray]:
    """Random inputs that are valid for the model's graph inputs."""
    return variant_inputs(MODELS[name].variant(size), seed)


def variant_inputs(variant: ZooVariant, seed: int = SEED) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {spec.name: _random_value(spec, rng) for spec in variant.inputs}


def model_path(name: str, size: str = "full", out_dir: str | os.PathLike[str] | None = None) -> Path:
    _check_size(size)
    directory = Path(out_dir) if out_dir is not None else DEFAULT_DIRS[size]
    return directory / f"{name}.onnx"


def ensure_model(name: str, size: str = "full", out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the path of the exported model, exporting it first if missing."""
    path = model_path(name, size, out_dir)
    if not path.exists():
        export_model(name, size, path)
    return path


def build_module(name: str, size: str = "full") -> nn.Module:
    """The seeded torch model that ``export_model`` exports, in eval mode."""
    return build_variant(MODELS[name].variant(size))


def build_variant(variant: ZooVariant) -> nn.Module:
    torch.manual_seed(SEED)
    module = variant.build().eval()
    _randomize_constant_init(module)
    return module


def export_model(name: str, size: str, path: Path) -> ExportReport:
    """Export, validate, and only then move the model into place at ``path``."""
    return export_variant(name, size, MODELS[name].variant(size), path)


def export_variant(name: str, size: str, variant: ZooVariant, path: Path) -> ExportReport:
    """Export ``variant`` (any model described as the zoo's are, see bench/unseen.py) to ``path``."""
    inputs = variant_inputs(variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.{os.getpid()}.partial")
    start = time.perf_counter()
    try:
        expected = _export_torchscript(build_variant(variant), variant, inputs, staging)
        _declare_static_outputs(staging, variant.outputs)
        max_abs_diff = _validate(staging, variant, inputs, expected)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return ExportReport(name, size, path, time.perf_counter() - start, max_abs_diff)


def graph_stats(path: Path) -> GraphStats:
    graph = onnx.load(str(path), load_external_data=False).graph
    histogram = collections.Counter(node.op_type for node in graph.node)
    return GraphStats(path.stat().st_size, len(graph.node), histogram)


# --- export and validation ---------------------------------------------------


def _random_value(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    if spec.kind == "token_ids":
        assert spec.vocab_size is not None, spec
        return rng.integers(0, spec.vocab_size, size=spec.shape, dtype=spec.dtype)
    if spec.kind == "mask":
        return np.ones(spec.shape, dtype=spec.dtype)
    return rng.standard_normal(spec.shape).astype(spec.dtype)


def _randomize_constant_init(module: nn.Module) -> None:
    """Replace the constant initial values of biases, norms and batch-norm statistics.

    Fresh models start with zero biases, unit norm scales and zero/one running
    statistics.  Such graphs are unrealistically degenerate (every bias add is a
    no-op) and the exporter deduplicates the equal initializers into Identity
    nodes, so give these tensors small random values, as a trained model has.
    """
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.02)
        for layer in module.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                mean, variance = layer.running_mean, layer.running_var
                if mean is not None and variance is not None:
                    mean.normal_(0.0, 0.02)
                    variance.uniform_(0.8, 1.2)


def _export_torchscript(
    module: nn.Module, variant: ZooVariant, inputs: dict[str, np.ndarray], path: Path
) -> list[np.ndarray]:
    """Export ``module`` to ``path`` and return its torch outputs on ``inputs``."""
    args = tuple(torch.from_numpy(inputs[spec.name]) for spec in variant.inputs)
    with torch.no_grad():
        outputs = module(*args)
        expected = [t.numpy() for t in (outputs if isinstance(outputs, tuple) else (outputs,))]
        with warnings.catch_warnings():
            # Tracing static shapes is the point; transformers' shape checks trigger these.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            # The TorchScript exporter is chosen on purpose (see the module docstring).
            warnings.filterwarnings("ignore", "You are using the legacy TorchScript-based", DeprecationWarning)
            torch.onnx.export(
                module,
                args,
                str(path),
                dynamo=False,
                opset_version=OPSET,
                do_constant_folding=True,
                input_names=[spec.name for spec in variant.inputs],
                output_names=[spec.name for spec in variant.outputs],
            )
    return expected


def _declare_static_outputs(path: Path, outputs: tuple[TensorSpec, ...]) -> None:
    """Write the spec's static shapes into the graph outputs.

    The TorchScript exporter loses track of shapes after a Pad whose pads it
    cannot constant-fold (EfficientNet's TF-style padding) and declares made-up
    symbolic output dims; the shapes are checked against onnxruntime afterwards.
    """
    model = onnx.load(str(path))
    for value, spec in zip(model.graph.output, outputs, strict=True):
        assert value.name == spec.name, (value.name, spec.name)
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        dims.extend(onnx.TensorShapeProto.Dimension(dim_value=size) for size in spec.shape)
    onnx.save(model, str(path))


def _validate(path: Path, variant: ZooVariant, inputs: dict[str, np.ndarray], expected: list[np.ndarray]) -> float:
    """Check the ONNX file and compare onnxruntime with torch; return the max abs diff."""
    onnx.checker.check_model(str(path))
    onnx.shape_inference.infer_shapes(onnx.load(str(path)), check_type=True, strict_mode=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    actual = session.run([spec.name for spec in variant.outputs], inputs)
    max_abs_diff = 0.0
    for spec, got, want in zip(variant.outputs, actual, expected, strict=True):
        if got.shape != spec.shape or want.shape != spec.shape:
            raise AssertionError(f"{spec.name}: onnx {got.shape}, torch {want.shape}, spec {spec.shape}")
        diff = float(np.max(np.abs(got - want)))
        tolerance = ATOL + RTOL * float(np.max(np.abs(want)))
        if not diff <= tolerance:
            raise AssertionError(f"{spec.name}: onnxruntime differs from torch by {diff} > {tolerance}")
        max_abs_diff = max(max_abs_diff, diff)
    return max_abs_diff


# --- CLI ---------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Export the Kiln model zoo to ONNX.")
    parser.add_argument("--size", choices=(*SIZES, "all"), default="full")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names (default: all)")
    parser.add_argument("--out", type=Path, help="output directory (default: bench/models or tests/fixtures/zoo)")
    parser.add_argument("--force", action="store_true", help="re-export models that already exist")
    args = parser.parse_args(argv)
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    if args.size == "all" and args.out is not None:
        parser.error("--out needs a single --size (full and tiny files share names)")
    return args


def _format_stats(stats: GraphStats, top: int = 10) -> str:
    ops = ", ".join(f"{op}:{count}" for op, count in stats.op_histogram.most_common(top))
    return f"{stats.file_bytes / 1e6:9.3f} MB  {stats.node_count:6d} nodes  {ops}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    sizes = SIZES if args.size == "all" else (args.size,)
    for size in sizes:
        for name in args.models:
            path = model_path(name, size, args.out)
            if path.exists() and not args.force:
                status = "exists"
            else:
                report = export_model(name, size, path)
                status = f"{report.seconds:6.1f}s  maxdiff {report.max_abs_diff:.1e}"
            print(f"{size:4s} {name:16s} {status}  {_format_stats(graph_stats(path))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
