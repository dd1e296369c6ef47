"""The training side: model, data, DeepSpeed engine, step loop (`python -m trainer.segment`)."""

from trainer.extensions import use_private_extensions_dir

use_private_extensions_dir()  # before anything builds a DeepSpeed op (trainer/extensions.py)
