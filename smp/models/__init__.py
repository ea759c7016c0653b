"""Built-in model zoo (GPT, BERT, T5, ResNet, U-Net, MLP, Hugging Face GPT-2/BERT/T5) and the model spec string."""

from __future__ import annotations

# First: spec imports the zoo modules in the order `smp models` lists them (importing one registers it).
from smp.models.spec import (  # isort: skip
    ModelBundle,
    build,
    build_step,
    get_model_info,
    list_models,
    parse_spec,
    with_batch,
)
from smp.models.bert import BERT
from smp.models.gpt import GPT
from smp.models.mlp import MLP
from smp.models.registry import BuildContext, Built, ModelInfo, Option, SpecError, register_model
from smp.models.resnet import ResNet
from smp.models.t5 import T5
from smp.models.unet import UNet

__all__ = [
    "build",
    "build_step",
    "with_batch",
    "parse_spec",
    "list_models",
    "get_model_info",
    "register_model",
    "ModelBundle",
    "ModelInfo",
    "Option",
    "SpecError",
    "BuildContext",
    "Built",
    "GPT",
    "BERT",
    "T5",
    "ResNet",
    "UNet",
    "MLP",
    "preset_table",
]


def preset_table(meta: bool = True) -> list[dict[str, object]]:
    """One row per (model, preset): parameter count and fp32 bytes, built on the meta device (no memory).

    Hugging Face entries are skipped when transformers is not importable.
    """
    rows: list[dict[str, object]] = []
    for info in list_models():
        for preset in info.presets:
            try:
                bundle = build(f"{info.name}:size={preset}", meta=meta)
            except SpecError:
                if info.name.startswith("hf-"):
                    continue
                raise
            cfg = {k: v for k, v in info.presets[preset].items()}
            rows.append(
                {
                    "model": info.name,
                    "preset": preset,
                    "params": bundle.num_params(),
                    "bytes": bundle.param_bytes(),
                    "config": cfg,
                }
            )
    return rows
