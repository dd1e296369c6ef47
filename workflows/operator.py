"""Moved: the operator commands' admission and queue are workflows/operator_queue.py, the LR
windows workflows/lr_windows.py. This name stays only for tests/trainer/
test_lr_windows_file.py's import of compose_windows; remove it once that names
workflows.lr_windows."""

from __future__ import annotations

from workflows.lr_windows import compose_windows

__all__ = ["compose_windows"]
