"""Architectures outside the zoo: the generalisation set of issue 13's speed target.

Kiln is measured on the zoo (bench/zoo.py) and tuned against it; these models check that what
works there holds for architectures it was not developed on. Each is built like the zoo's full
models (transformers config in code, random weights seeded, nothing downloaded, TorchScript
export at opset 14, batch 1, sequence 128, images at the published size, validated against
torch through onnxruntime) and exported to ``bench/models/unseen/<name>.onnx`` (git-ignored):

=================  ==========================================================================
roberta-base       RoBERTa-base: BERT's shape, position ids counted from the padding token
deberta-v3-base    DeBERTa-v3-base (DebertaV2): disentangled relative attention, 256 buckets
electra-small      ELECTRA-small discriminator: embedding 128 projected to hidden 256
deit-small         DeiT-small/16: ViT with a distillation token, hidden 384, 6 heads
beit-base          BEiT-base/16: relative position bias per layer, layer scale, mean pooling
regnet-y-040       RegNetY-4.0GF: grouped 3x3 convs (group width 64), squeeze-excitation
mobilevit-small    MobileViT-S at 256x256: inverted residuals with unfold/fold transformer blocks
swinv2-tiny        Swin-V2-T/4, window 8 at 256x256: cosine attention, log-spaced position MLP
levit-128          LeViT-128: conv stem, attention with BatchNorm, subsampling attention
=================  ==========================================================================

Do not tune Kiln for these shapes. ``--check`` compiles each export with Kiln and runs
``kiln verify`` on it through the command line, as a user would, and prints what failed.

    python bench/unseen.py [--models a,b] [--out DIR] [--force] [--check] [--timeout S]
    python bench/latency.py --models unseen      # the speed comparison on all of them
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import (
    BeitConfig,
    BeitModel,
    DebertaV2Config,
    DebertaV2Model,
    DeiTConfig,
    DeiTModel,
    ElectraConfig,
    ElectraModel,
    LevitConfig,
    LevitModel,
    MobileViTConfig,
    MobileViTModel,
    RegNetConfig,
    RegNetModel,
    RobertaConfig,
    RobertaModel,
    Swinv2Config,
    Swinv2Model,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.zoo import (  # noqa: E402
    FULL_IMAGE,
    FULL_SEQ,
    REPO_ROOT,
    TensorSpec,
    ZooVariant,
    _feature_map_outputs,
    _hf_variant,
    _image_inputs,
    _sequence_outputs,
    _text_model,
    export_variant,
    graph_stats,
    variant_inputs,
)

DEFAULT_DIR = REPO_ROOT / "bench" / "models" / "unseen"
CHECK_TIMEOUT_S = 1800


@dataclass(frozen=True)
class UnseenModel:
    name: str
    description: str
    variant: ZooVariant


def _vision(model_class, config_class, config: dict, image: int,
            outputs: tuple[TensorSpec, ...]) -> ZooVariant:
    return _hf_variant(model_class, config_class, {**config, "image_size": image},
                       _image_inputs(image), outputs)


def _pooled_tokens(tokens: int, hidden: int) -> tuple[TensorSpec, ...]:
    return _sequence_outputs(tokens, hidden, pooled=True)


MODELS: dict[str, UnseenModel] = {
    m.name: m
    for m in (
        UnseenModel("roberta-base", "RoBERTa-base: 12 layers, hidden 768, 12 heads", _text_model(
            RobertaModel, RobertaConfig,
            {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "max_position_embeddings": 514, "type_vocab_size": 1,
             "pad_token_id": 1},
            vocab=50265, seq=FULL_SEQ, hidden=768)),
        UnseenModel("deberta-v3-base", "DeBERTa-v3-base: 12 layers, hidden 768, relative attention",
                    _text_model(
            DebertaV2Model, DebertaV2Config,
            {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "relative_attention": True, "max_relative_positions": -1,
             "position_buckets": 256, "pos_att_type": ["p2c", "c2p"], "norm_rel_ebd": "layer_norm",
             "share_att_key": True, "position_biased_input": False, "type_vocab_size": 0},
            vocab=128100, seq=FULL_SEQ, hidden=768, pooled=False)),
        UnseenModel("electra-small", "ELECTRA-small discriminator: 12 layers, hidden 256", _text_model(
            ElectraModel, ElectraConfig,
            {"embedding_size": 128, "hidden_size": 256, "num_hidden_layers": 12,
             "num_attention_heads": 4, "intermediate_size": 1024},
            vocab=30522, seq=FULL_SEQ, hidden=256, pooled=False)),
        UnseenModel("deit-small", "DeiT-small/16 at 224x224 with distillation token", _vision(
            DeiTModel, DeiTConfig,
            {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6,
             "intermediate_size": 1536, "patch_size": 16, "attn_implementation": "eager"},
            FULL_IMAGE, _pooled_tokens((FULL_IMAGE // 16) ** 2 + 2, 384))),
        UnseenModel("beit-base", "BEiT-base/16 at 224x224, relative position bias", _vision(
            BeitModel, BeitConfig,
            {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "patch_size": 16, "use_relative_position_bias": True,
             "use_mean_pooling": True, "layer_scale_init_value": 0.1,
             "attn_implementation": "eager"},
            FULL_IMAGE, _pooled_tokens((FULL_IMAGE // 16) ** 2 + 1, 768))),
        UnseenModel("regnet-y-040", "RegNetY-4.0GF at 224x224", _vision(
            RegNetModel, RegNetConfig,
            {"embedding_size": 32, "hidden_sizes": [128, 192, 512, 1088], "depths": [2, 6, 12, 2],
             "groups_width": 64, "layer_type": "y"},
            FULL_IMAGE, _feature_map_outputs(1088, FULL_IMAGE // 32, flat_pooler=False))),
        UnseenModel("mobilevit-small", "MobileViT-S at 256x256", _vision(
            MobileViTModel, MobileViTConfig,
            {"hidden_sizes": [144, 192, 240],
             "neck_hidden_sizes": [16, 32, 64, 96, 128, 160, 640]},
            256, _feature_map_outputs(640, 256 // 32, flat_pooler=True))),
        UnseenModel("swinv2-tiny", "Swin-V2-T/4, window 8, at 256x256", _vision(
            Swinv2Model, Swinv2Config,
            {"embed_dim": 96, "depths": [2, 2, 6, 2], "num_heads": [3, 6, 12, 24],
             "window_size": 8, "patch_size": 4},
            256, _pooled_tokens((256 // 32) ** 2, 768))),
        UnseenModel("levit-128", "LeViT-128 at 224x224", _vision(
            LevitModel, LevitConfig,
            {"hidden_sizes": [128, 256, 384], "num_attention_heads": [4, 8, 12],
             "depths": [4, 4, 4], "key_dim": [16, 16, 16]},
            # 14x14 patches, subsampled twice with stride 2 (rounding up): 7x7, then 4x4.
            FULL_IMAGE, _pooled_tokens(4 * 4, 384))),
    )
}


def model_path(name: str, out_dir: Path | None = None) -> Path:
    return (out_dir or DEFAULT_DIR) / f"{name}.onnx"


def ensure_model(name: str, out_dir: Path | None = None) -> Path:
    """The exported model, exporting it first if missing."""
    path = model_path(name, out_dir)
    if not path.exists():
        export_variant(name, "full", MODELS[name].variant, path)
    return path


def make_inputs(name: str) -> dict[str, np.ndarray]:
    return variant_inputs(MODELS[name].variant)


def check_with_kiln(path: Path, timeout_s: float) -> tuple[str, str]:
    """Compile `path` with the `kiln` command line and verify the artifact against onnxruntime:
    ("ok", summary) or (the failing step, its error)."""
    with tempfile.TemporaryDirectory(prefix="kiln-unseen-") as tmp:
        artifact = Path(tmp) / "model.kiln"
        for step, args in (("compile", ["compile", str(path), "-o", str(artifact)]),
                           ("verify", ["verify", str(artifact), str(path)])):
            try:
                done = subprocess.run([sys.executable, "-m", "kiln.cli", *args], cwd=REPO_ROOT,
                                      capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return step, f"timed out after {timeout_s:g} s"
            if done.returncode != 0:
                lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
                return step, " | ".join(lines[-3:]) if lines else f"exit {done.returncode}"
            if step == "compile":
                summary = next((line for line in done.stdout.splitlines()
                                if line.startswith("wrote ")), "").split(": ", 1)[-1]
        return "ok", summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("--out", type=Path, help=f"output directory (default {DEFAULT_DIR})")
    parser.add_argument("--force", action="store_true", help="re-export models that exist")
    parser.add_argument("--check", action="store_true",
                        help="compile each with Kiln and run `kiln verify` on it")
    parser.add_argument("--timeout", type=float, default=CHECK_TIMEOUT_S, metavar="S",
                        help="limit for each kiln command")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    failed = 0
    for name in names:
        path = model_path(name, args.out)
        status = "exists"
        if args.force or not path.exists():
            start = time.perf_counter()
            try:
                report = export_variant(name, "full", MODELS[name].variant, path)
            except Exception as exc:  # an export failure is a finding to report, not a crash
                print(f"{name:16s} export FAILED: {type(exc).__name__}: {exc}", flush=True)
                failed += 1
                continue
            status = f"exported in {time.perf_counter() - start:.0f} s, maxdiff {report.max_abs_diff:.1e}"
        stats = graph_stats(path)
        print(f"{name:16s} {status}; {stats.file_bytes / 1e6:.0f} MB, {stats.node_count} nodes",
              flush=True)
        if args.check:
            start = time.perf_counter()
            step, detail = check_with_kiln(path, args.timeout)
            failed += step != "ok"
            print(f"{'':16s} kiln: {'compiled and verified' if step == 'ok' else step + ' FAILED'}"
                  f" ({time.perf_counter() - start:.0f} s): {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
