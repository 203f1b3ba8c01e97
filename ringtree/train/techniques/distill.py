"""Knowledge distillation (Hinton et al., 2015): a student learns from a teacher's softened outputs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ringtree.train import checkpoint


def distillation_loss(
    student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float, alpha: float
) -> torch.Tensor:
    """alpha x T^2 x KL(softmax(teacher/T) || softmax(student/T)) + (1 - alpha) x cross-entropy.

    The T^2 keeps the soft term's gradients on the same scale as the hard one's whatever T is.
    student, teacher: logits [b, classes]; labels [b].
    """
    hard = F.cross_entropy(student, labels)
    return alpha * soft_loss(student, teacher, temperature) + (1 - alpha) * hard


def soft_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 x KL(softmax(teacher/T) || softmax(student/T)): the teacher's term of distillation_loss."""
    log_p_student = F.log_softmax(student / temperature, dim=1)
    log_p_teacher = F.log_softmax(teacher / temperature, dim=1)
    soft = F.kl_div(log_p_student, log_p_teacher, reduction="batchmean", log_target=True)
    return temperature**2 * soft


def check_distill(temperature: float, alpha: float) -> None:
    """Raise ValueError for a temperature that is not positive or an alpha outside [0, 1]."""
    if temperature <= 0:
        raise ValueError(f"distill temperature must be positive, got {temperature}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"distill alpha must be between 0 and 1 (the soft loss's weight), got {alpha}")


def load_teacher(
    path: str | Path, build: Callable[[str], nn.Module], report: Callable[[str], None] | None = None
) -> tuple[nn.Module, str]:
    """The model a `ringtree train --checkpoint-dir` run saved (the file or its folder), in eval mode.

    A folder (or its last.pt) gives its newest verified checkpoint, a damaged one skipped and
    reported through `report`. build(name) makes an empty model of the checkpoint's recorded kind;
    returns (model, name).
    """
    file = teacher_file(path)
    if file.is_dir():  # a sharded checkpoint (--zero): its pieces assembled into the dense model
        return _sharded_teacher(file, build)
    file, state = _teacher_state(file, report)
    name = state.get("model_name") if isinstance(state, dict) else None
    if not isinstance(name, str) or "model" not in state:
        raise ValueError(
            f"{file} records no model kind ('model_name') or weights ('model'); "
            "pass a checkpoint that `ringtree train --checkpoint-dir DIR` wrote"
        )
    teacher = build(name)
    try:
        teacher.load_state_dict(state["model"])
    except RuntimeError as e:
        raise ValueError(f"{file} does not fit a fresh {name!r} model: {e}") from None
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher, name


def _teacher_state(file: Path, report: Callable[[str], None] | None) -> tuple[Path, dict[str, Any]]:
    """(file, state): last.pt stands for its folder's newest verified checkpoint; weights_only."""
    if file.name != checkpoint.LATEST:
        return file, checkpoint.read(file)  # a damaged file is named, with why
    found = checkpoint.newest(file.parent, report)
    assert found is not None  # the folder holds last.pt, so it has a candidate
    return found


def _sharded_teacher(folder: Path, build: Callable[[str], nn.Module]) -> tuple[nn.Module, str]:
    from ringtree.train import sharded_checkpoint

    found = sharded_checkpoint.find(folder) if not folder.name.endswith(".dcp") else None
    path = found[0] if found is not None else folder
    record = sharded_checkpoint.verify(path)
    teacher = build(str(record["model_name"]))
    dense = [(n, tuple(q.shape)) for n, q in teacher.named_parameters()]
    teacher.load_state_dict(sharded_checkpoint.dense_state(path, dense, None)["model"])
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher, str(record["model_name"])


def teacher_file(path: str | Path) -> Path:
    """The checkpoint that `path` names: a file, the folder `ringtree train` wrote into (its
    last.pt), or a folder of sharded checkpoints (--zero) or one of them (step-N.dcp)."""
    folder = Path(path)
    if folder.is_dir() and (folder.name.endswith(".dcp") or any(folder.glob("step-*.dcp"))):
        return folder
    file = folder / checkpoint.LATEST if folder.is_dir() else folder
    if not file.is_file():
        raise ValueError(
            f"no teacher checkpoint at {file}; train one first with "
            "`ringtree train --checkpoint-dir DIR` and pass --teacher DIR (or DIR/last.pt)"
        )
    return file
