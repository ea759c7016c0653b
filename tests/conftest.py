"""Shared test set-up: offline Hugging Face, deterministic torch, small thread count."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
