"""Built-in model zoo (GPT, BERT, T5, ResNet, U-Net, MLP, Hugging Face GPT-2/BERT/T5) and the model spec string."""

from __future__ import annotations

from smp.models.spec import (
    BuildContext,
    Built,
    ModelBundle,
    ModelInfo,
    Option,
    SpecError,
    build,
    build_step,
    get_model_info,
    list_models,
    parse_spec,
    register_model,
    with_batch,
)

# Importing the zoo modules registers their models; the order here is the order `smp models` lists.
from smp.models import gpt, bert, t5, resnet, unet, mlp, hf  # noqa: E402,F401  isort: skip
from smp.models.gpt import GPT  # noqa: E402
from smp.models.bert import BERT  # noqa: E402
from smp.models.t5 import T5  # noqa: E402
from smp.models.resnet import ResNet  # noqa: E402
from smp.models.unet import UNet  # noqa: E402
from smp.models.mlp import MLP  # noqa: E402

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
