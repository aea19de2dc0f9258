"""Link torch, torchvision and what they require from this venv into another venv's site-packages.

CI checks the lean install (``pip install -e .``) in a venv of its own. Installing torch's CUDA
build a second time needs about 5.5 GB more disk, which a CI machine does not always have (one
run failed with ``No space left on device``). Linking the very files the first venv installed
gives the lean venv the same torch a real install would, at no cost in disk; every other
dependency is still installed by pip from gpulens's own declaration.

Usage: python share_torch.py TARGET_SITE_PACKAGES
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOTS = ("torch", "torchvision")


def closure(roots: tuple[str, ...]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``roots`` need, with environment markers evaluated."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement this venv does not have
        found[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def main(target: Path) -> None:
    linked = 0
    for dist in closure(ROOTS).values():
        site = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            src, dst = site / top, target / top
            if src.exists() and not dst.exists() and not top.endswith(".pth"):
                os.symlink(src, dst)
                linked += 1
    print(f"share_torch: linked {linked} entries of {', '.join(ROOTS)} and their requirements")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
