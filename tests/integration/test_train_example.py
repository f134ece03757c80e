"""examples/train_treelstm.py: workers and in-process end on the same loss; resume works."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.multiprocess

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_treelstm.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_treelstm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_treelstm"] = module  # workers unpickle its classes by this name
    spec.loader.exec_module(module)
    return module


def test_workers_and_in_process_agree_and_resume_continues(tmp_path: Path) -> None:
    example = load_example()
    common = ["--limit", "96", "--batch-size", "16", "--dim", "8", "--quiet"]

    def run(*extra: str, checkpoint: str) -> float:
        loss: float = example.main([*common, *extra, "--checkpoint", str(tmp_path / checkpoint)])
        return loss

    in_process = run("--in-process", "--epochs", "2", checkpoint="a.pt")
    workers = run("--workers", "1", "--epochs", "2", checkpoint="b.pt")
    run("--workers", "1", "--epochs", "1", checkpoint="c.pt")
    resumed = run("--workers", "1", "--epochs", "2", "--resume", checkpoint="c.pt")
    assert workers == in_process == resumed
